"""The version fuse sees tokenizers: a real vLLM canary serving the same model path with another
tokenizer has another fingerprint, and its route is fused — 503 with both fingerprints, for a
streamed call as well (before the first byte) — while the production route keeps serving.

Two vLLM servers: production is the session's tiny-llama; the canary is the same weights with
a tokenizer that lost half of its BPE merges (same vocabulary, other token ids)."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.mmguard import RunningMmguard
from tests.support.vllm import VllmServer

pytestmark = pytest.mark.vllm


def other_tokenizer(model_dir: Path, dst: Path) -> Path:
    """The model's tokenizer files, with the second half of the BPE merges dropped."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, dst / name)
    doc = json.loads((dst / "tokenizer.json").read_text())
    merges = doc["model"]["merges"]
    doc["model"]["merges"] = merges[: len(merges) // 2]
    (dst / "tokenizer.json").write_text(json.dumps(doc))
    return dst


@pytest.fixture(scope="module")
def vllm_other_tokenizer(vllm_models: dict[str, Path],
                         tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    tmp = tmp_path_factory.mktemp("vllm_other_tok")
    tok = other_tokenizer(vllm_models["tiny-llama"], tmp / "tokenizer")
    server = VllmServer(vllm_models["tiny-llama"], "tiny-llama", log_path=tmp / "vllm.log",
                        extra_args=["--tokenizer", str(tok)])
    try:
        server.start()
        yield server
    finally:
        server.stop()


def routes(prod: VllmServer, canary: VllmServer) -> dict[str, object]:
    return {"backends": [{"kind": "vllm", "name": "prod", "url": prod.url},
                         {"kind": "vllm", "name": "canary", "url": canary.url}],
            "models": [{"name": "chat", "backend": "prod", "backend_model": prod.model},
                       {"name": "chat_canary", "backend": "canary",
                        "backend_model": canary.model}]}


def test_a_canary_with_another_tokenizer_is_fused(vllm_llama: VllmServer,
                                                  vllm_other_tokenizer: VllmServer) -> None:
    cfg = routes(vllm_llama, vllm_other_tokenizer)
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        contracts = m.server.plane.runtime.contracts  # type: ignore[union-attr]
        good, other = contracts["chat"], contracts["chat_canary"]
    # what the old fingerprint hashed is the same on both: path, max_model_len, vLLM version
    for key in ("root", "max_model_len", "vllm_version"):
        assert good.config[key] == other.config[key], key
    assert good.config["tokenizer"]["probe_ids_sha256"] != \
        other.config["tokenizer"]["probe_ids_sha256"]
    assert good.fingerprint != other.fingerprint
    fused = dict(cfg)
    fused["models"] = [cfg["models"][0],  # type: ignore[index]
                       {**cfg["models"][1],  # type: ignore[index]
                        "filters": [{"fallback": {"expect_fingerprint": {
                            "chat_canary": good.fingerprint}, "cache": None}}]}]
    with RunningMmguard(fused) as m:
        m.wait_ready(timeout=120)
        client = openai.OpenAI(base_url=f"http://{m.http_url}/v1", api_key="unused",
                               max_retries=0)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "say hello"}]
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as exc:
                reply = client.chat.completions.create(model="chat_canary", messages=messages,
                                                       max_tokens=4, stream=stream)
                if stream:
                    list(reply)
            assert exc.value.status_code == 503
            text = str(exc.value)
            assert good.fingerprint in text and other.fingerprint in text, text
            assert exc.value.response.headers["mmguard-fallback-fuse"].startswith("fused")
        # the production route keeps serving, streamed and not
        ok = client.chat.completions.create(model="chat", messages=messages, max_tokens=4,
                                            temperature=0)
        assert ok.choices[0].message.content is not None
        chunks = list(client.chat.completions.create(model="chat", messages=messages,
                                                     max_tokens=4, temperature=0, stream=True))
        assert chunks
        metrics = urllib.request.urlopen(m.admin_url + "/metrics").read().decode()
        line = next(x for x in metrics.splitlines()
                    if x.startswith("mmguard_model_load_mismatch_total{")
                    and 'route="chat_canary"' in x)
        assert float(line.rsplit(" ", 1)[1]) >= 2.0
