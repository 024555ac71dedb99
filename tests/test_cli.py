from __future__ import annotations

import json

import pytest

from attnselect.cli import main


def test_explain_json_shape(capsys):
    assert main(["explain", "--target", "b200", "--model", "deepseek-v3", "--train", "--causal", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"problem", "target", "chosen", "candidates"}
    assert data["chosen"] == {"backend": "sdpa_cudnn", "pad_to": None}
    assert data["problem"]["heads_q"] == 128 and data["problem"]["head_dim_qk"] == 192
    for c in data["candidates"]:
        assert set(c) >= {"backend", "pad_to", "supported", "reasons", "rank"}
        assert c["supported"] == (c["rank"] is not None) == (not c["reasons"])
    padded = next(c for c in data["candidates"] if c["backend"] == "sdpa_cudnn" and c["pad_to"] == 192)
    assert any("no backward kernel" in r for r in padded["reasons"])


def test_explain_table_defaults_to_embedded_target(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 (sm90)" in out and "chosen:  sdpa_cudnn native" in out
    for header in ("backend", "padded to", "supported", "rank", "reasons"):
        assert header in out


def test_explain_as_calibrated_ranks_the_embedded_target_by_predicted_time(capsys):
    """The H200 preset at the versions its packaged calibration measured: every candidate's predicted time."""
    assert main(["explain", "--as-calibrated", "--layout", "thd", "--batch", "52", "--seqlen", "10269",
                 "--tokens", "65536", "--train", "--causal"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "torch 2.11.0+cu130, cuDNN 9.19.0, flash-attn-4 4.0.0b36, nvidia-cudnn-frontend 1.32.0" in out
    assert "ranked:  by predicted time in a stack of layers" in out and "predicted us (host, GPU)" in out
    # the GPU part as in results/cpu_explain_packed_64k_tokens.txt; the host part from the host times of 2026-12-06
    assert "flash_attn4     -          yes        1     7206.7 (464.2, 7090.6)" in out
    assert main(["explain", "--as-calibrated", "--cudnn-version", "9.10.0"]) == 0  # a flag given wins
    assert "ranked:  by the rules table" in capsys.readouterr().out


def test_explain_as_calibrated_refuses_a_calibration_that_does_not_hold(monkeypatch, capsys):
    """Another attnselect than the one that calibrated: the promise of predicted times would not hold."""
    import attnselect
    from attnselect.choose import calibration

    monkeypatch.setattr(calibration, "_version", lambda: "9.9.9")
    attnselect.clear_cache()
    try:
        assert main(["explain", "--as-calibrated"]) == 2
    finally:
        monkeypatch.undo()
        attnselect.clear_cache()
    err = capsys.readouterr().err
    assert "--as-calibrated: the packaged calibration does not hold (" in err and "expected it to" in err


def test_explain_explicit_shape_and_cudnn_override(capsys):
    assert (
        main(
            [
                "explain",
                "--target",
                "b200",
                "--cudnn-version",
                "9.10.0",
                "--head-dim-qk",
                "192",
                "--head-dim-v",
                "128",
                "--heads",
                "16",
                "--kv-heads",
                "4",
                "--seqlen",
                "1024",
                "--batch",
                "1",
                "--layout",
                "thd",
                "--train",
                "--dtype",
                "fp16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "cuDNN 9.10.0" in out and "Hkv=4" in out and "thd" in out and "chosen:  varlen_fa2 padded to 192" in out


def test_explain_reports_failure_with_reasons(capsys):
    assert main(["explain", "--target", "cpu", "--cp", "2", "--train", "--backend", "sdpa_math"]) == 2
    err = capsys.readouterr().err
    assert "ForcedChoiceError" in err and "by which context parallelism merges its chunks" in err


def test_demo_runs_a_real_attention(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "relative error against a float64 reference: out" in out and "dq" in out and "running " in out


def test_backends_lists_every_backend(capsys):
    from attnselect.backends import all_backends

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert all(b.name in out for b in all_backends()) and "available" in out


def test_tune_measures_and_stores(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    assert main(["tune", "--model", "llama-3-70b", "--seqlen", "16", "--phase", "inference", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "tuning 1 problems" in out and "[####################] 1/1" in out
    assert (tmp_path / "decisions.json").exists()


def test_bench_smoke_compares_every_policy(tmp_path, monkeypatch, capsys):
    from attnselect.bench import POLICIES

    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    assert main(["bench", "--smoke", "--out", str(tmp_path / "bench")]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert len(report["results"]) == 4
    for entry in report["results"]:
        assert set(entry["policies"]) == set(POLICIES) and entry["best_ms"] > 0 and entry["seconds"] >= 0
    assert "| problem | rules | measure | te |" in (tmp_path / "bench.md").read_text()
    assert "measure" in capsys.readouterr().out
    (tmp_path / "bench.md").unlink()
    assert main(["bench", "--render", "--out", str(tmp_path / "bench")]) == 0  # no re-run, same table
    assert "| problem | rules | measure | te |" in (tmp_path / "bench.md").read_text()
    assert len(json.loads((tmp_path / "bench.json").read_text())["results"]) == 4
    assert main(["bench", "--out", str(tmp_path / "joined"), "--merge", str(tmp_path / "bench.json")]) == 0
    assert json.loads((tmp_path / "joined.json").read_text()) == json.loads((tmp_path / "bench.json").read_text())
    assert "| problem | rules | measure | te |" in (tmp_path / "joined.md").read_text()


def test_bench_render_and_merge_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--out", "unused", "--render", "--merge", "part.json"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("shard", ["2/2", "1", "a/b", "1/0"])
def test_bench_shard_must_be_k_of_n(shard, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--out", "unused", "--shard", shard])
    assert "expected K/N with 0 <= K < N" in capsys.readouterr().err


def test_flags_given_win_over_the_model(capsys):
    assert main(["explain", "--target", "h200", "--model", "deepseek-v3", "--heads", "8", "--kv-heads", "8",
                 "--json"]) == 0  # fmt: skip
    problem = json.loads(capsys.readouterr().out)["problem"]
    assert (problem["heads_q"], problem["heads_kv"], problem["head_dim_qk"]) == (8, 8, 192)


def test_explain_refuses_what_context_parallelism_refuses(capsys):
    assert main(["explain", "--target", "h200", "--cp", "2", "--causal", "bottom_right"]) == 2
    assert "causal: got mask 'causal_bottom_right' with context_parallel_size=2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--cp", "0"], "--cp (context_parallel_size): got 0, expected"),
        (["--heads", "0"], "--heads (heads_q): got 0, expected"),
        (["--dropout", "1.5"], "--dropout (dropout_p): got 1.5, expected"),
        (["--target", "cpu", "--cudnn-version", "9.1.0"], "--cudnn-version: got '9.1.0', expected none for the cpu"),
        (["--tokens", "4096"], "--tokens (tokens): got 4096, expected 0 unless layout is 'thd'"),
        (["--as-calibrated", "--target", "h100"], "--as-calibrated: no calibration is packaged for the NVIDIA H100"),
        (["--as-calibrated", "--target", "a100"], "--as-calibrated: no calibration is packaged for the NVIDIA A100"),
        (["--as-calibrated", "--target", "cpu"], "--as-calibrated: got --target cpu, expected a GPU preset"),
        (["--as-calibrated", "--target", "current"], "--as-calibrated: got --target current, expected a GPU preset"),
    ],
)
def test_explain_names_the_flag_of_a_bad_value(flags, message, capsys):
    assert main(["explain", *flags]) == 2
    assert message in capsys.readouterr().err


def test_explain_takes_a_packing_s_tokens(capsys):
    assert main(["explain", "--layout", "thd", "--batch", "52", "--seqlen", "10269", "--tokens", "65536"]) == 0
    assert "thd 52 seqs in 65536 tokens, max sq=10269" in capsys.readouterr().out


def test_explain_takes_a_given_zero_as_given(capsys):
    assert main(["explain", "--seqlen", "128", "--seqlen-kv", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problem"]["seqlen_kv"] == 0


@pytest.mark.parametrize("how", [["--render"], ["--merge", "missing-part.json"]])
def test_bench_names_a_report_it_cannot_read(how, tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path / "none"), *how]) == 2
    assert "bench: cannot read the report (FileNotFoundError" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text(json.dumps({"results": [1, 2]}))  # a JSON file, not a bench report
    assert main(["bench", "--out", str(tmp_path / "junk"), "--render"]) == 2
    assert "bench: cannot read the report (" in capsys.readouterr().err


def test_warmup_makes_the_model_shapes_first_calls(capsys):
    args = ["warmup", "--model", "llama-3-70b", "--seqlen", "16", "--dtype", "fp32", "--layout", "thd", "--batch", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "warming up 2 problems" in out and "2/2 thd" in out and " in " in out
    assert main([*args, "--backend", "flash_attn4"]) == 1  # not installed here: each call reported
    assert "failed: thd" in capsys.readouterr().err
    assert main([*args, "--backend", "no_such_backend"]) == 2  # the library's error, before any call
    assert main([*args, "--tokens", "24"]) == 0 and "2 seqs in 24 tokens" in capsys.readouterr().out
    dense = ["warmup", "--model", "llama-3-70b", "--seqlen", "16", "--dtype", "fp32", "--cuda-graph"]
    assert main(dense) == 0 and capsys.readouterr().out.count("under CUDA graph capture:") == 2


@pytest.mark.parametrize(
    "command,flags,message",
    [
        ("warmup", ["--batch", "0"], "InvalidInputError: --batch: got 0, expected at least 1"),
        ("warmup", ["--seqlen", "16", "0"], "InvalidInputError: --seqlen: got 0, expected lengths of at least 1"),
        ("tune", ["--seqlen", "0"], "InvalidInputError: --seqlen: got 0, expected lengths of at least 1"),
        ("warmup", ["--layout", "thd", "--batch", "2", "--tokens", "33"], "--tokens: got 33, expected 0 (half of"),
        ("warmup", ["--tokens", "8"], "--tokens: got 8 with --layout bshd, expected it with --layout thd only"),
        ("warmup", ["--backend", "no_such_backend"], "ForcedChoiceError: --backend (backend): got 'no_such_backend'"),
    ],
)
def test_tune_and_warmup_name_a_flag_that_makes_no_call_before_starting(command, flags, message, capsys):
    assert main([command, "--model", "llama-3-70b", "--seqlen", "16", "--dtype", "fp32", *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""  # nothing started, no header printed
