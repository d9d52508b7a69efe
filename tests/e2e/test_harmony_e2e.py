"""A checkpoint in gpt-oss's chat format (`moelab synth --chat-template gpt_oss`: the harmony
tokens and template) served through a real `mgr` on the CPU: started from a profile with no
parser flag, its chat replies read as harmony (a forced call that the model ends with `<|call|>`,
steered by logit_bias since the weights are random, comes back as a tool call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.engine.model.tokenizer import Tokenizer
from tests.daemon.conftest import http, start_mgr, synth
from tests.daemon.test_engines import READY_S, wait_status


@pytest.mark.slow
def test_a_harmony_checkpoint_serves_its_format_through_mgr(tmp_path: Path) -> None:
    models = tmp_path / "models"
    model = synth(models / "tiny-harmony", "--chat-template", "gpt_oss")
    [call_token] = Tokenizer(model).encode("<|call|>")
    mgr = start_mgr(tmp_path / "data", "--models-dir", str(models))
    try:
        profile = mgr.post(
            "/api/profiles",
            {"name": "harmony", "model": str(model), "flags": ["--device", "cpu"]},
        )
        server = mgr.post("/api/servers", {"profile_id": profile["id"]}, expect=(202,))
        server = wait_status(mgr, server["id"], ("running", "crashed", "failed"), READY_S)
        assert server["status"] == "running", mgr.get(f"/api/servers/{server['id']}/logs")
        served = http("GET", server["url"] + "/v1/models")[1]["data"][0]["id"]
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        status, reply = http(
            "POST",
            server["url"] + "/v1/chat/completions",
            {
                "model": served,
                "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [weather],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "max_tokens": 8,
                "logit_bias": {str(call_token): 100},
            },
            timeout=120,
        )
        assert status == 200, reply
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        # the prompt opened the call; the model ended it at once, without arguments
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {}
        mgr.post(f"/api/servers/{server['id']}/stop")
    finally:
        mgr.stop()
