"""A newcomer's mistakes when starting the roles by hand: one line on stderr naming the fix,
exit status 2, no traceback (`decentrl.cli.main`, in process)."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from decentrl.cli import main
from decentrl.client import CoordinatorClient, CoordinatorUnavailable


def one_line_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("decentrl: error: ")
    return err


def test_an_empty_token_is_one_line(capsys, tmp_path: Path) -> None:
    argv = ["trainer", "--coordinator", "http://127.0.0.1:9", "--token=", "--run-dir", str(tmp_path)]
    assert "--token is empty" in one_line_error(capsys, argv)


def test_a_coordinator_url_without_its_scheme_is_one_line(capsys) -> None:
    err = one_line_error(capsys, ["worker", "--coordinator", "localhost:8760", "--token=x"])
    assert "is not a URL" in err and "http://localhost:8760" in err


def model_dir(tmp_path: Path, architecture: str, tokenizer: bool) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], "vocab_size": 8}))
    if tokenizer:
        (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_a_model_directory_without_a_tokenizer_is_one_line(capsys, tmp_path: Path) -> None:
    model = model_dir(tmp_path / "model", "Qwen2ForCausalLM", tokenizer=False)
    err = one_line_error(
        capsys, ["coordinator", "--run-dir", str(tmp_path / "run"), "--model-dir", str(model)]
    )
    assert "has no tokenizer.json" in err


def test_a_masked_lm_is_refused_as_a_policy(capsys, tmp_path: Path) -> None:
    model = model_dir(tmp_path / "bert", "BertForMaskedLM", tokenizer=True)
    err = one_line_error(
        capsys, ["coordinator", "--run-dir", str(tmp_path / "run"), "--model-dir", str(model)]
    )
    assert "BertForMaskedLM, not a causal LM" in err


def test_a_port_in_use_is_one_line(capsys, tmp_path: Path) -> None:
    from decentrl.config import ModelConfig
    from decentrl.model.tiny import build_tiny, save_model_dir

    model = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "model")
    capsys.readouterr()  # its progress bar
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = [
            "coordinator",
            "--run-dir",
            str(tmp_path / "run"),
            "--model-dir",
            str(model),
            "--port",
            str(port),
        ]
        err = one_line_error(capsys, argv)
    assert f"cannot listen on 127.0.0.1:{port}" in err and "pick another port" in err


def test_repeated_connection_failures_ask_whether_the_coordinator_runs(caplog) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
    client = CoordinatorClient(url, "token", base_delay=0.001, max_delay=0.01, max_wait=5)
    with caplog.at_level(logging.WARNING, "decentrl.client"), pytest.raises(CoordinatorUnavailable):
        client.health()
    assert f"is the coordinator running at {url}?" in caplog.text
