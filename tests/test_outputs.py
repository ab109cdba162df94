"""Output paths are checked before any work: a directory where a file is wanted, a file where a
directory is wanted, or a path under a file, is one clear error (exit 2), not a traceback."""

import pytest

from tether.cli import main
from tether.data import DataError, write_records
from tether.outputs import output_problem


@pytest.fixture
def bad(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("user's file\n")
    return tmp_path


def test_output_problem_names_the_path(bad):
    assert output_problem(bad / "adir", "file", "--out") == f"--out {bad / 'adir'} is a directory, expected a file path"
    assert output_problem(bad / "afile", "dir", "--out") == f"--out {bad / 'afile'} is a file, expected a directory"
    assert output_problem(bad / "afile" / "x" / "y.json", "file", "OUT") == (
        f"OUT {bad / 'afile' / 'x' / 'y.json'} cannot be created: {bad / 'afile'} is a file, not a directory"
    )
    assert output_problem(bad / "new" / "deeper", "dir", "--out") is None
    assert output_problem(bad / "adir", "dir", "--out") is None
    assert output_problem(bad / "afile", "file", "--out") is None  # overwriting a file is allowed


def test_eval_checks_out_before_evaluating(bad, capsys):
    # Regression: IsADirectoryError after the whole evaluation; FileExistsError from out.mkdir.
    assert main(["eval", "embedded", "embedded", "--out", str(bad / "adir")]) == 2
    assert f"tether eval: --out {bad / 'adir'} is a directory, expected a file path" in capsys.readouterr().err
    assert main(["eval", "embedded", "embedded", "--checkpoints", "all", "--out", str(bad / "afile")]) == 2
    assert f"--out {bad / 'afile'} is a file, expected a directory" in capsys.readouterr().err


def test_sweep_and_sft_check_out(bad, capsys):
    assert (
        main(["sweep", "--grid", "kl.coef=0.1,0.2", "trainer.total_steps=2", "--out", str(bad / "afile"), "--dry-run"])
        == 2
    )
    assert f"tether sweep: the sweep's out {bad / 'afile'} is a file, expected a directory" in capsys.readouterr().err
    assert main(["sft", "--out", str(bad / "afile"), "--steps", "1"]) == 2
    assert f"tether sft: --out {bad / 'afile'} is a file, expected a directory" in capsys.readouterr().err
    assert (bad / "afile").read_text() == "user's file\n"


def test_data_output_under_a_file_is_a_data_error(bad, tmp_path):
    with pytest.raises(DataError, match="cannot be created: .*afile is a file, not a directory"):
        write_records([{"prompt": "p"}], bad / "afile" / "x.parquet")
    with pytest.raises(DataError, match="adir.jsonl is a directory"):
        (bad / "adir.jsonl").mkdir()
        write_records([{"prompt": "p"}], bad / "adir.jsonl")
