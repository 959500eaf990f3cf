"""bench.openai's pure helpers for the LiteLLM row: the proxy's config and install commands, the
one-line reason for a skip, and the summary rows (each target against the direct cell of the
same run; a failed cell gives no numbers, not zeros)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import litellm_peer, openai_report


def test_the_proxy_fronts_the_given_vllm_with_the_key_from_the_environment() -> None:
    cfg = litellm_peer.proxy_config("tiny-llama", "http://127.0.0.1:8123/")
    (entry,) = cfg["model_list"]
    assert entry["model_name"] == "tiny-llama"
    assert entry["litellm_params"]["model"] == "hosted_vllm/tiny-llama"
    assert entry["litellm_params"]["api_base"] == "http://127.0.0.1:8123/v1"
    assert cfg["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"


def test_install_makes_its_own_venv_and_installs_the_proxy_extra(tmp_path: Path) -> None:
    venv = tmp_path / "v"
    make, install = litellm_peer.install_commands(venv, "/usr/bin/python3")
    assert make == ["/usr/bin/python3", "-m", "venv", str(venv)]
    assert install[0] == str(venv / "bin" / "python") and install[1:4] == ["-m", "pip", "install"]
    assert install[-1] == "litellm[proxy]"
    assert litellm_peer.installed_version(venv) is None  # nothing there yet: not installed


def test_a_skip_reason_is_the_last_line_that_says_something() -> None:
    out = "Collecting litellm\n  ERROR: No matching distribution found for litellm\n\n"
    assert litellm_peer.last_line(out) == "ERROR: No matching distribution found for litellm"
    assert litellm_peer.last_line("") == "no output"
    assert len(litellm_peer.last_line("x" * 1000, limit=50)) == 50


def cell(rps: float, ttft: float, cpu: dict[str, float], **extra: Any) -> dict[str, Any]:
    return {"rps": rps, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 2, "e2e_p50_ms": ttft + 50,
            "e2e_p99_ms": ttft + 90, "requests": 100, "errors": 0, "other_cpu_pct": 1.0,
            "cpu_ms_per_req": cpu, "runq_wait_ms_per_req": {k: v / 10 for k, v in cpu.items()},
            **extra}


def test_each_proxy_is_measured_against_the_direct_cell_of_its_run() -> None:
    rows = [{"concurrency": 32,
             "direct": cell(800.0, 10.0, {"mmguard": 0.01, "vllm": 50.0}),
             "mmguard": cell(600.0, 11.0, {"mmguard": 1.5, "litellm": 0.02}),
             "litellm": cell(20.0, 30.0, {"litellm": 40.0, "mmguard": 0.01})}]
    d, m, lite = openai_report.summary_rows(rows)
    assert [s["target"] for s in (d, m, lite)] == ["direct", "mmguard", "litellm"]
    assert d["x_direct"] == 1.0 and d["added_ttft_p50_ms"] is None
    assert d["proxy_cpu_ms_per_req"] is None
    assert m["x_direct"] == 0.75 and m["added_ttft_p50_ms"] == 1.0
    assert m["proxy_cpu_ms_per_req"] == 1.5 and m["proxy_runq_wait_ms_per_req"] == 0.15
    assert lite["x_direct"] == 0.025 and lite["added_ttft_p99_ms"] == 40.0
    assert lite["proxy_cpu_ms_per_req"] == 40.0  # its own process, not mmguard's
    text = openai_report.table([d, m, lite], md=True)
    assert "| 32 | litellm | 30.0 | 60.0 | +20.00 |" in text


def test_a_failed_cell_gives_no_numbers_and_says_fail() -> None:
    rows = [{"concurrency": 1, "direct": cell(10.0, 5.0, {}),
             "litellm": cell(9.0, 6.0, {"litellm": 40.0}, failed="text differs")}]
    _, lite = openai_report.summary_rows(rows)
    assert lite["errors"] == "FAIL"
    assert lite["rps"] is None and lite["x_direct"] is None and lite["added_ttft_p50_ms"] is None
    assert lite["proxy_cpu_ms_per_req"] is None
    failed_direct = [{"concurrency": 1, "direct": {"failed": "boom", "requests": 0},
                      "mmguard": cell(9.0, 6.0, {"mmguard": 1.0})}]
    _, m = openai_report.summary_rows(failed_direct)
    assert m["rps"] == 9.0 and m["x_direct"] is None and m["added_ttft_p50_ms"] is None
