"""attnselect's errors (attnselect.errors): every public entry point answers a wrong argument with one, naming it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnselect
from attnselect import AttentionProblem, InvalidInputError, Target

P = AttentionProblem(1, 64, 64, 4, 4, 24, 16, torch.float32)


def test_every_error_is_an_attnselect_error_the_package_exports_and_the_builtin_a_caller_catches():
    import inspect

    from attnselect import errors

    classes = {name: c for name, c in vars(errors).items() if inspect.isclass(c) and c.__module__ == errors.__name__}
    assert set(classes) == {"AttnSelectError", "InvalidInputError", "NoSupportedCandidateError", "ForcedChoiceError"}
    assert all(getattr(attnselect, name) is c and name in attnselect.__all__ for name, c in classes.items())
    assert all(issubclass(c, errors.AttnSelectError) for c in classes.values())
    builtins = {name: next(b for b in c.__mro__ if b.__module__ == "builtins") for name, c in classes.items()}
    assert builtins == {"AttnSelectError": Exception, "InvalidInputError": ValueError,
                        "NoSupportedCandidateError": RuntimeError, "ForcedChoiceError": ValueError}  # fmt: skip
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="causal: got 1"):  # caught as the builtin error, as torch's would be
        attnselect.attention(q, q, q, causal=1)


def test_a_preset_name_is_taken_wherever_a_target_is():
    assert attnselect.select(P, target="b200").target == Target.preset("b200")
    assert "b200" in attnselect.explain(P, target="b200").lower()
    with pytest.raises(InvalidInputError, match="target: got 'b2000'"):
        attnselect.explain(P, target="b2000")
    with pytest.raises(InvalidInputError, match="target: got int"):
        attnselect.select(P, target=3)


def test_select_names_a_tensor_given_for_the_problem():
    with pytest.raises(InvalidInputError, match="problem: got Tensor.*from_tensors"):
        attnselect.select(torch.zeros(1, 4, 2, 8))


def test_from_tensors_names_a_misspelt_argument():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(InvalidInputError, match="casual.*did you mean 'causal'"):
        AttentionProblem.from_tensors(q, q, q, casual=True)


@pytest.mark.parametrize("version", ["abc", "9", "", 9.1])
def test_versions_are_validated(version):
    with pytest.raises(InvalidInputError, match="cudnn_version: got"):
        Target.preset("b200", cudnn_version=version)
    assert Target.preset("b200", cudnn_version="9.19.0").cudnn_version == "9.19.0"
    assert Target.preset("h200", packages={"flash-attn-4": "4.0.0b36"}, torch_version="2.11.0+cu130")


def test_booleans_are_booleans():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(InvalidInputError, match="return_lse: got 'yes'"):
        attnselect.attention(q, q, q, return_lse="yes")
    with pytest.raises(InvalidInputError, match="training: got 1"):
        dataclasses.replace(P, training=1)
    with pytest.raises(InvalidInputError, match="batch: got True"):
        dataclasses.replace(P, batch=True)


def test_zero_heads_say_so():
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 0, 16)
    with pytest.raises(InvalidInputError, match="at least one head each"):
        attnselect.attention(q, k, k)


def test_explain_raises_on_a_backend_that_does_not_exist_or_cannot_serve():
    with pytest.raises(attnselect.ForcedChoiceError, match="sdpa_cuddn"):
        attnselect.explain(P, target="cpu", backend="sdpa_cuddn")
    with pytest.raises(attnselect.ForcedChoiceError, match="runs on cuda"):
        attnselect.explain(P, target="cpu", backend="sdpa_cudnn")


def test_the_cli_prints_a_forced_choice_that_cannot_serve(capsys):
    from attnselect.cli import main

    assert main(["explain", "--target", "cpu", "--backend", "sdpa_cudnn"]) == 2
    assert "ForcedChoiceError" in capsys.readouterr().err


def test_explain_lists_the_supported_candidates_and_groups_the_rest_by_reason():
    report = attnselect.explain(P, target="h200")
    assert "package not installed: " in report and "package nvidia-cudnn-frontend is not installed" not in report
    full = attnselect.explain(P, target="h200", show_all=True)
    assert "package nvidia-cudnn-frontend is not installed" in full and len(full) > len(report)
    with pytest.raises(InvalidInputError, match="show_all"):
        attnselect.explain(P, target="h200", show_all="yes")


def test_a_package_without_metadata_still_makes_a_target():
    assert Target.preset("h200", packages={"flash-attn-3": "unknown"}).version("flash-attn-3") == "unknown"
    assert Target.preset("h200", torch_version="4.0.0b36+local_x")  # PEP 440 local part with an underscore
    with pytest.raises(InvalidInputError, match="torch_version"):
        Target.preset("h200", torch_version="2.11.0+" + "a" * 40 + "_")  # refused, and at once


def test_an_argument_the_slow_path_refuses_is_refused_whatever_ran_before():
    q = torch.randn(1, 8, 2, 16)
    attnselect.attention(q, q, q, causal=True, return_lse=False)  # memoized
    with pytest.raises(InvalidInputError, match="causal: got 1"):
        attnselect.attention(q, q, q, causal=1)
    with pytest.raises(InvalidInputError, match="return_lse: got 0"):
        attnselect.attention(q, q, q, causal=True, return_lse=0)


def test_a_value_of_the_wrong_type_is_shown_as_given():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(InvalidInputError, match="dropout_p: got '0.1'"):
        attnselect.attention(q, q, q, dropout_p="0.1")
    t = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="max_seqlen_q: got '8'"):
        attnselect.attention(t, t, t, layout="thd", cu_seqlens_q=cu, max_seqlen_q="8", max_seqlen_kv=8)
    with pytest.raises(InvalidInputError, match="batch: got '1'"):
        dataclasses.replace(P, batch="1")
    with pytest.raises(InvalidInputError, match="dtype: got 'fp16'"):
        dataclasses.replace(P, dtype="fp16")


def test_the_cli_refuses_zero_kv_heads(capsys):
    from attnselect.cli import main

    assert main(["explain", "--kv-heads", "0"]) == 2
    assert "--kv-heads (heads_kv): got 0" in capsys.readouterr().err


def test_the_grouped_report_keeps_every_reason_whole():
    report = attnselect.explain(dataclasses.replace(P, head_dim_qk=192, head_dim_v=192, dtype=torch.bfloat16,
                                                    training=True), target="b200")  # fmt: skip
    reason = "head dims 192/192 on sm100 need cuDNN > 9.22 (only 192/128 is served from 9.11); the target has cuDNN"
    assert f"{reason} 9.19.0: sdpa_cudnn" in report  # longer than 100 characters, whole
