"""The chain study's pure parts (bench/chain_study.py): the config it writes is one mmguard
accepts and runs the chains it says, its fault drill selects none of the bench's calls, and its
summary computes each filter's delta from the cells."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import chain_study as study
from filters.fault.config import ExperimentConfig
from proxy.call import headers_match
from proxy.config.model import Defaults, load_config


def _write(tmp_path: Path, chains: list[str]) -> Path:
    doc = study.chain_config(chains, "127.0.0.1:8001", "127.0.0.1:8000", "tok")
    path = tmp_path / "mmguard.yaml"
    path.write_text(json.dumps(doc))
    return path


def test_every_chain_is_a_config_mmguard_accepts(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, list(study.STUDY)), check_files=True)
    routes = {r.name: r for r in cfg.models}
    for chain in study.STUDY:
        percent = study.CHAINS[chain][1]
        for proto in study.PROTOCOLS:
            front = routes[study.route(chain, proto)]
            assert front.backend == f"triton_{proto}"
            assert front.backend_model == "pixel_identity"
            names = [spec.name for spec in cfg.chain(front)]
            assert names == list(study.steps_of(chain))
            if "shadow" in names:
                shadow = next(s.config for s in cfg.chain(front) if s.name == "shadow")
                assert shadow.percent == percent  # type: ignore[attr-defined]
                assert shadow.canary in routes  # type: ignore[attr-defined]
                assert shadow.verdict.max_latency_ratio is None  # type: ignore[attr-defined]
    # the full chain has the filters, the router innermost over two paths
    full = routes[study.route("full", "grpc")]
    specs = {s.name: s.config for s in cfg.chain(full)}
    assert set(specs) == {"limits", "shape_guard", "quality", "output_drift", "shadow",
                          "fallback", "fault", "modality_router"}
    assert [s.name for s in cfg.chain(full)][-1] == "modality_router"
    paths = [p.route for p in specs["modality_router"].paths]  # type: ignore[attr-defined]
    assert len(paths) == 2 and all(routes[p].backend == "triton_grpc" for p in paths)
    assert specs["shape_guard"].inputs["input_ids"].max_tokens == 77  # type: ignore[attr-defined]
    assert specs["fallback"].cache is not None  # type: ignore[attr-defined]
    assert "pixel_values" in specs["quality"].images  # type: ignore[attr-defined]
    assert specs["quality"].sample == 1.0  # type: ignore[attr-defined]
    lean = {s.name: s.config for s in cfg.chain(routes[study.route("full_lean", "http")])}
    assert lean["quality"].sample == 0.1  # type: ignore[attr-defined]
    assert lean["fallback"].cache is None  # type: ignore[attr-defined]
    assert lean["fallback"].breaker == specs["fallback"].breaker  # type: ignore[attr-defined]
    # full less quality: every other filter, configured as in full
    rest = {s.name: s.config for s in cfg.chain(routes[study.route("full_no_quality", "grpc")])}
    assert set(rest) == set(specs) - {"quality"}
    assert all(rest[n] == specs[n] for n in rest if n not in ("shadow", "modality_router"))


def test_the_default_chain_is_mmguards_default(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, ["default"]))
    front = next(r for r in cfg.models if r.name == study.route("default", "http"))
    assert tuple(front.filters or ()) == Defaults().filters
    assert [r.name for r in cfg.models] == ["chain-default-grpc", "chain-default-http"]


def test_the_drill_is_valid_and_selects_none_of_the_bench_calls() -> None:
    body = study.drill("full", "grpc")
    assert body["route"] == "chain-full-grpc"
    exp = ExperimentConfig.model_validate(body["experiment"])
    bench_headers = {study.CANARY_HEADER: "1"}  # what the load generator sends
    assert not headers_match(exp.headers, bench_headers)
    assert headers_match(exp.headers, {**bench_headers, study.DRILL_HEADER: "x"})
    assert study.has_fault("full") and not study.has_fault("fallback")


def test_parse_chains_orders_and_names_the_unknown() -> None:
    assert study.parse_chains("full, default") == ["default", "full"]
    with pytest.raises(ValueError, match="'fulll'"):
        study.parse_chains("default,fulll")


def _cell(chain: str, proto: str, cpu: float, **extra: Any) -> dict[str, Any]:
    return {"chain": chain, "protocol": proto, "rps": 100.0, "other_cpu_pct": 1.0,
            "cpu_ms_per_req": {"mmguard": cpu}, **extra}


def test_summarize_takes_medians_and_deltas() -> None:
    cells = [_cell("default", "grpc", 2.0), _cell("default", "grpc", 2.2),
             _cell("default", "grpc", 9.0, other_cpu_pct=40.0),
             _cell("quality", "grpc", 2.9), _cell("full", "grpc", 3.1),
             _cell("full_shadow10", "grpc", 3.6, header_count=0),
             _cell("full_lean", "grpc", 2.5),
             _cell("full", "grpc", 1.0, failed="boom")]
    rows = {r["chain"]: r for r in study.summarize(cells)}
    assert rows["default"]["mmguard_cpu_ms_per_req"] == pytest.approx(2.2)
    assert rows["default"]["noisy"] == 1 and rows["default"]["delta_prev_ms"] is None
    assert rows["quality"]["delta_prev_ms"] == pytest.approx(0.7)
    assert rows["full"]["mmguard_cpu_ms_per_req"] == pytest.approx(3.1)  # the failed one left out
    assert rows["full"]["failed"] == 1
    assert rows["full"]["delta_prev_ms"] == pytest.approx(0.2)
    assert rows["full"]["delta_default_ms"] == pytest.approx(0.9)
    assert rows["full_shadow10"]["delta_prev_ms"] == pytest.approx(0.5)  # over full
    assert rows["full_shadow10"]["delta_default_ms"] == pytest.approx(1.4)
    assert rows["full_lean"]["delta_prev_ms"] == pytest.approx(-0.6)  # over full too
    table = study.chain_table(study.summarize(cells), md=True)
    assert "| + quality | grpc | 2.900 |" in table


def test_round_robin_interleaves_the_chains() -> None:
    order = study.round_robin(["default", "full"], 2)
    assert [c for _, c, _ in order] == ["default", "default", "full", "full"] * 2
    assert [r for r, _, _ in order] == [0] * 4 + [1] * 4


def test_chain_profile_runs_with_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench/chain_profile.py`` with the breakdown and reused signals: it patches the quality
    filter's own reference to its signals, and a rename there must not leave the option dead."""
    import filters.quality.filter as quality
    from bench import chain_profile

    real = getattr(quality, "measure_image")  # noqa: B009  (not re-exported)
    assert chain_profile.main(["--chains", "default,full", "--calls", "3", "--repeats", "1",
                               "--breakdown", "--reuse-signals"]) == 0
    assert getattr(quality, "measure_image") is real  # noqa: B009  (put back)
    out = capsys.readouterr().out
    assert "each filter's own CPU per call" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("default", "full")}
    assert set(rows) == {"default", "full"}
