"""tether view's data and server, without a browser: the index, details, events, scales and bad input."""

import json
import socket
import threading
import urllib.error
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tether.cli import main
from tether.records import read_records, record_files
from tether.viewer import ViewError, load_run, make_server, render_html, sample_details, summary
from tether.viewer.data import events, mean_per_response, scale


def _table(kl_lists):
    return pa.table({"kl": pa.array(kl_lists, type=pa.list_(pa.float32()))})


def test_mean_per_response_and_scale_by_hand():
    t = _table([[0.5, -0.25, float("nan")], [], [2.0], [1.0, 3.0]])
    assert mean_per_response(t, "kl") == [pytest.approx(0.125), None, 2.0, 2.0]  # NaN left out; empty: None
    # |values| = 0.5, 0.25, 2, 1, 3 -> the 99th percentile ("higher") is the largest, 3
    assert scale(t, "kl") == 3.0
    assert scale(_table([[], [float("nan")]]), "kl") == 1.0  # nothing finite: a neutral scale


def test_events_are_guard_events_and_findings_once_each():
    class F:
        check, message, suggestion, evidence = "kl_rising", "KL rose", "raise kl.coef", {"steps": [1, 5, 9]}

    history = [
        {"step": 1, "guard/rollbacks": 0, "guard/coef_scale": 1.0, "guard/early_stop": 1.0},
        # one rollback is one event (the new-user trial saw it twice: the key and the counter's rise)
        {"step": 2, "guard/rollbacks": 1, "guard/coef_scale": 2.0, "guard/rollback": 1.0, "guard/kl_explosion": 2.0},
        {"step": 3, "guard/rollbacks": 1, "guard/nonfinite_skip": 0.0},
    ]
    got = events(history, [F()])
    assert [(e["step"], e["kind"], e["text"]) for e in got] == [
        (2, "guard", "guard/kl_explosion = 2"),
        (2, "guard", "guard/rollback (1 so far)"),
        (9, "doctor", "kl_rising: KL rose — raise kl.coef"),
    ]  # guard/early_stop (PPO's target-KL stop, by design) is not an event


@pytest.mark.slow
def test_summary_and_details_are_the_records(recorded_run):
    view = load_run(recorded_run)
    table, _ = read_records(recorded_run)
    s = summary(view)
    ix = s["index"]
    # 5 training responses at steps 1-4; every validation sample (2 prompts x val_n 2) at steps 0, 2, 4
    assert ix["n"] == table.num_rows == 20 + 12 and sorted(set(ix["step"])) == [0, 1, 2, 3, 4]
    assert ix["kind"].count("val") == 12 and all(
        k == "val" for k, s in zip(ix["kind"], ix["step"], strict=True) if s == 0
    )
    assert ix["step"] == sorted(ix["step"])  # sample id i is row i of the files in step order
    assert set(s["curves"]) >= {"reward", "KL (nats/token)", "entropy (nats)", "β", "val score"}
    rows = table.to_pylist()
    for d in sample_details(view, [0, 7, 19]):
        r = rows[d["id"]]
        assert d["tokens"] == r["tokens"] and d["response_ids"] == r["response_ids"] and d["step"] == r["step"]
        assert d["kl"] == pytest.approx(r["kl"]) and len(d["tokens"]) == ix["length"][d["id"]]
        assert ix["prompt"][d["id"]] == ix["prompts"].index(r["prompt"])
    assert sample_details(view, [-1, 10**6]) == []  # ids outside the table are ignored
    html = render_html(view)
    assert "/*__TETHER_DATA__*/" not in html and html.count('"details"') == 1


def test_bad_run_directories_are_one_line_each(tmp_path, capsys):
    with pytest.raises(ViewError, match="missing: no such directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ViewError, match="file: not a directory"):
        load_run(tmp_path / "file")
    with pytest.raises(ViewError, match="no metrics.jsonl and no rollouts/"):
        load_run(tmp_path)
    assert main(["view", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tether view: ") and "no such directory" in err[0]
    for port in ("99999", "-1"):  # the new-user trial's traceback (OverflowError from bind)
        assert main(["view", str(tmp_path), "--port", port]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"tether view: --port {port} is not a port: give 0-65535 (0 = any free one)"]


def test_a_run_without_records_says_how_to_record_and_a_corrupt_file_is_skipped_and_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/score_mean": 0.5}\n{"step": 2, "reward/sc')
    s = summary(load_run(tmp_path))  # a half-written last line (a run still training) is not a crash
    assert s["index"] == {"n": 0} and "trainer.log_rollouts=N" in s["how_to_record"]
    assert s["curves"]["reward"] == [[1, 0.5]]
    d = tmp_path / "rollouts"
    d.mkdir()
    (d / "step_0000002.parquet").write_bytes(b"PAR1 truncated")
    (d / ".step_0000003.parquet.tmp-123").write_bytes(b"being written")  # a temporary: not a record file
    s = summary(load_run(tmp_path))
    assert len(s["problems"]) == 1 and "step_0000002.parquet" in s["problems"][0] and "skipped" in s["problems"][0]


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type"), r.read()


@pytest.mark.slow
def test_the_server_serves_the_page_summary_and_samples_and_reads_new_records(recorded_run, tmp_path):
    server = make_server(recorded_run, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        code, kind, body = _get(base + "/")
        assert code == 200 and kind.startswith("text/html") and b"tether view" in body
        code, _, body = _get(base + "/api/summary")
        assert json.loads(body)["index"]["n"] == 32
        code, _, body = _get(base + "/api/samples?ids=3,1")
        assert [d["id"] for d in json.loads(body)] == [3, 1]
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(base + "/api/samples?ids=one")
        assert e.value.code == 400
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(base + "/nothing")
        assert e.value.code == 404
        # a run still being written: a new record file is read at the next summary
        step, path = record_files(recorded_run)[-1]
        extra = pq.read_table(path)
        new = path.with_name(f"step_{step + 1:07d}.parquet")
        pq.write_table(extra, new)
        try:
            assert json.loads(_get(base + "/api/summary")[2])["index"]["n"] == 32 + extra.num_rows
        finally:
            new.unlink()
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_in_use_is_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kl/ref_mean": 0.01}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ViewError, match=f"port {port} on 127.0.0.1 is in use: pass --port"):
            make_server(tmp_path, port=port)
        assert main(["view", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is in use" in err[0]


def test_html_export_is_written_whole(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kl/ref_mean": 0.01}\n')
    out = tmp_path / "page.html"
    assert main(["view", str(tmp_path), "--html", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>") and "opens offline" in capsys.readouterr().out
