"""The app's API as ``gradio_client`` sees it: optional inputs optional, no remote default file, whole-number
inputs typed int, and refusals that name the field (and, for a backend, why it cannot run here)."""

from __future__ import annotations

import pytest

gr_client = pytest.importorskip("gradio_client", reason="gradio_client is not installed here (pip install -r "
                                "requirements.txt)")
from gradio_client.exceptions import AppError  # noqa: E402

from tests.test_app import args  # noqa: E402
from tests.test_operator import served  # noqa: E402,F401 - the module-scoped running app

INTEGER_FIELDS = ("seed", "token_hop_len_first", "token_hop_len", "pre_lookahead_len", "max_tokens")


@pytest.fixture(scope="module")
def api(served):  # noqa: F811
    client = served[0]
    return {p["parameter_name"]: p for p in client.view_api(print_info=False, return_format="dict")
            ["named_endpoints"]["/synthesize"]["parameters"]}


def test_optional_inputs_are_optional(api):
    for name in ("prompt_mic", "instruct_text", "speaker", "prompt_upload"):
        assert api[name]["parameter_has_default"], name
    assert api["prompt_mic"]["parameter_default"] is None and api["speaker"]["parameter_default"] is None
    assert api["instruct_text"]["parameter_default"] == ""
    assert all(p["parameter_has_default"] for p in api.values())  # every input has a default or is optional


def test_no_file_default_and_no_remote_url(served, api):
    assert api["prompt_upload"]["parameter_default"] is None
    text = served[0].view_api(print_info=False, return_format="str")
    assert "github.com" not in text and "/tmp/" not in text


def test_whole_number_inputs_are_typed_int(api):
    for name in INTEGER_FIELDS:
        assert api[name]["python_type"]["type"] == "int", (name, api[name]["python_type"])
    assert api["stream_scale_factor"]["python_type"]["type"] == "float"
    assert api["token_hop_len_first"]["type"]["description"] == "whole number from 1 to 100"


def test_flow_backends_do_not_repeat_the_incremental_checkbox(api):
    assert "incremental" not in api["flow"]["python_type"]["type"]
    assert api["incremental_flow"]["python_type"]["type"] == "bool"


@pytest.mark.parametrize("over, message", [
    (dict(token_hop_len_first=2.7),
     "token_hop_len_first=2.7 must be a whole number from 1 to 100 (it is not rounded for you)."),
    (dict(token_hop_len_first=0), "token_hop_len_first=0 is out of range: use a whole number from 1 to 100."),
    (dict(pre_lookahead_len=4), "pre_lookahead_len=4 is out of range: use a whole number from 0 to 3."),
    (dict(stream_scale_factor=9.5), "stream_scale_factor=9.5 is out of range: use a number from 1 to 4."),
    (dict(max_tokens="many"), "max_tokens='many' is not a whole number: use a whole number from 0 to 2000."),
    (dict(seed=-1), "seed=-1 is out of range: use a whole number from 0 to 9223372036854775807."),
    (dict(seed=1.5), "seed=1.5 must be a whole number from 0 to 9223372036854775807 (it is not rounded for you)."),
    (dict(mode="clone"), "mode='clone' is not one of the choices: 'zero_shot', 'cross_lingual', 'instruct2', "
                         "'speaker'."),
    (dict(llm="cudagraph"), "llm='cudagraph' is not available here: needs a CUDA GPU (this engine runs on cpu). "
                            "Choose 'eager'."),
    (dict(flow="incremental"), "flow='incremental' is not available here: it is not a separate backend: use "
                               "flow='eager' with incremental_flow=True. Choose 'eager'."),
    (dict(dtype="bf16"), "dtype='bf16' is not available here: fp16/bf16 need a CUDA GPU (this engine runs on CPU). "
                         "Choose 'fp32'."),
])
def test_refusals_name_the_field(served, capfd, over, message):
    import torch

    if torch.cuda.is_available() and ("cudagraph" in over.values() or "bf16" in over.values()):
        pytest.skip("available on this machine")
    with pytest.raises(AppError) as e:
        served[0].predict(**args(**over), api_name="/synthesize")
    assert str(e.value) == message
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def test_whole_numbers_sent_as_floats_are_accepted(served):
    """2.0 from a JSON client is the whole number 2, not a mistake."""
    *_, tele = served[0].predict(**args(token_hop_len_first=10.0, max_tokens=20.0), api_name="/synthesize")
    assert tele["params"]["token_hop_len_first"] == 10
