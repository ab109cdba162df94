"""tether view in a real headless Chromium: the page loads, its counts are the records', a token's colour and
number are its KL, a filter narrows the list, the keyboard reaches everything, and the HTML export opens from
disk. Skipped, saying why, only where no Chromium can be installed (make install-browser)."""

import threading

import pytest

from tether.records import read_records
from tether.viewer import load_run, make_server, summary, write_html

pytestmark = pytest.mark.slow


def colour(v: float, s: float) -> str:
    """page.html's colour(): red for positive values, blue for negative, strength |v|/scale capped at 1."""
    a = min(abs(v) / s, 1.0)
    c = round(255 - 155 * a)
    return f"rgb(255, {c}, {c})" if v >= 0 else f"rgb({c}, {c}, 255)"


@pytest.fixture
def served(recorded_run):
    server = make_server(recorded_run, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=20_000)
    return page, errors


def test_the_page_loads_with_the_records_count_and_colours_a_token_by_its_kl(browser, served, recorded_run):
    table, _ = read_records(recorded_run)
    n = table.num_rows
    page, errors = open_page(browser, served)
    assert page.text_content("#count") == f"showing 1–{min(n, 20)} of {n} responses"
    assert page.locator("article.sample").count() == min(n, 20)
    assert f"{n} recorded responses at 5 steps" in page.text_content("#counts")
    # the first card is the latest step's first record (order: latest step first, then record order)
    first = page.locator("article.sample").first
    sid = int(first.get_attribute("data-id"))
    rec = table.slice(sid, 1).to_pylist()[0]
    assert rec["step"] == 4
    kl_scale = summary(load_run(recorded_run))["index"]["scales"]["kl"]
    tok = first.locator(".tok").nth(1)
    assert tok.text_content() == rec["tokens"][1]
    v = float(tok.get_attribute("data-v"))
    assert v == pytest.approx(rec["kl"][1], rel=1e-6)  # float32 written, printed by JS in full
    assert tok.evaluate("e => e.style.background") == colour(rec["kl"][1], kl_scale)
    tok.focus()  # numbers on focus: the keyboard user's hover
    tip = page.text_content("#tip")
    assert "KL term" in tip and f"id {rec['response_ids'][1]}" in tip and page.is_visible("#tip")
    assert errors == []


def test_a_filter_narrows_the_list_and_the_colour_follows_the_choice(browser, served, recorded_run):
    table, _ = read_records(recorded_run)
    page, errors = open_page(browser, served)
    page.select_option("#f-step", "2")
    at_2 = sum(1 for s in table.column("step").to_pylist() if s == 2)
    page.wait_for_function(f"document.getElementById('count').textContent.endsWith('of {at_2} responses')")
    cards = page.locator("article.sample")
    assert cards.count() == at_2 and all("step 2" in cards.nth(i).text_content() for i in range(at_2))
    page.fill("#f-rmin", "100")  # no reward is that high
    page.dispatch_event("#f-rmin", "change")
    page.wait_for_function("document.getElementById('count').textContent === 'no response matches the filters'")
    page.fill("#f-rmin", "")
    page.dispatch_event("#f-rmin", "change")
    page.select_option("#f-colour", "advantages")
    sid = int(page.locator("article.sample").first.get_attribute("data-id"))
    rec = table.slice(sid, 1).to_pylist()[0]
    tok = page.locator("article.sample").first.locator(".tok").first
    page.wait_for_function(
        "v => document.querySelector('article.sample .tok').dataset.v == v", arg=str(rec["advantages"][0])
    )
    assert float(tok.get_attribute("data-v")) == pytest.approx(rec["advantages"][0], rel=1e-6)
    assert errors == []


def test_the_keyboard_reaches_samples_pages_and_the_comparison(browser, served):
    page, errors = open_page(browser, served)
    page.keyboard.press("j")
    assert page.evaluate("document.activeElement.matches('article.sample')")
    first = page.evaluate("document.activeElement.dataset.id")
    page.keyboard.press("j")
    assert page.evaluate("document.activeElement.dataset.id") != first
    page.keyboard.press("c")  # the same prompt at two steps
    page.wait_for_selector("#compare:not([hidden]) .cols article.sample")
    assert page.locator("#compare select").count() == 2
    page.keyboard.press("Escape")
    assert page.is_hidden("#compare")
    page.keyboard.press("/")
    assert page.evaluate("document.activeElement.id") == "f-step"
    assert errors == []


def test_the_html_export_opens_from_disk_offline(browser, recorded_run, tmp_path):
    out = write_html(recorded_run, tmp_path / "run.html")
    table, _ = read_records(recorded_run)
    page, errors = open_page(browser, out.as_uri())
    assert page.text_content("#count") == f"showing 1–20 of {table.num_rows} responses"
    page.select_option("#f-step", "1")  # 5 training responses, no validation at step 1
    page.wait_for_function("document.getElementById('count').textContent.endsWith('of 5 responses')")
    assert page.locator("svg.curve").count() >= 4
    assert errors == []


def test_a_run_without_records_says_how_to_turn_them_on(browser, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kl/ref_mean": 0.01}\n{"step": 2, "kl/ref_mean": 0.02}\n')
    out = write_html(tmp_path, tmp_path / "page.html")
    page, errors = open_page(browser, out.as_uri())
    assert "trainer.log_rollouts=N" in page.text_content("#norecords") and page.is_hidden("#filters")
    assert page.locator("svg.curve").count() == 1 and errors == []
