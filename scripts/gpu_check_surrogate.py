"""GPU check of the gradient perturbations (``fgsm`` / PGD) with a TorchScript surrogate on CUDA.

Run on a machine with a CUDA torch build: ``python scripts/gpu_check_surrogate.py [OUT_DIR]``.
It builds a small conv "image–text similarity" surrogate, runs FGSM and PGD on the CPU and on
CUDA over the same images, and checks: both stay in the ε ball and in [0, 1]; both lower the
surrogate's score; CPU and CUDA agree on the perturbation's sign almost everywhere (they may
differ where the gradient is ~0). Prints the figures, and writes them to OUT_DIR/gpu_check.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from filters import perturb


class Similarity(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 16, 7, stride=4)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=g) * 0.1)
            self.conv.bias.zero_()
        self.text = torch.nn.Parameter(torch.randn(16, generator=g), requires_grad=False)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        emb = torch.relu(self.conv(image)).mean(dim=(2, 3))
        return torch.nn.functional.cosine_similarity(emb, self.text[None, :], dim=1)


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    assert torch.cuda.is_available(), "no CUDA device"
    path = Path(tempfile.mkdtemp()) / "surrogate.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(Similarity()).save(str(path))
    score = Similarity()
    report: dict[str, object] = {"torch": torch.__version__,
                                 "device": torch.cuda.get_device_name(0)}
    ok = True
    for batch in (1, 8):
        x = np.random.default_rng(batch).random((batch, 3, 224, 224), np.float32)
        base = float(score(torch.from_numpy(x)).mean())
        for steps in (1, 5):
            row: dict[str, object] = {}
            results = {}
            for device in ("cpu", "cuda"):
                loss = perturb.load_surrogate(str(path), mode="lower", device=device)
                perturb.fgsm(x, 0.03, loss, steps=steps)  # warm-up (CUDA context, JIT)
                t0 = time.perf_counter()
                for _ in range(5):
                    adv = perturb.fgsm(x, 0.03, loss, steps=steps)
                if device == "cuda":
                    torch.cuda.synchronize()
                row[f"{device}_ms"] = round((time.perf_counter() - t0) / 5 * 1000, 2)
                results[device] = adv
                within = float(np.abs(adv - x).max()) <= 0.03 + 1e-6
                bounded = float(adv.min()) >= 0 and float(adv.max()) <= 1
                lowered = float(score(torch.from_numpy(adv)).mean())
                row[f"{device}_score"] = round(lowered, 4)
                ok &= within and bounded and lowered < base
            agree = float((np.sign(results["cpu"] - x) == np.sign(results["cuda"] - x)).mean())
            row["sign_agreement"] = round(agree, 5)
            row["score_before"] = round(base, 4)
            ok &= agree > 0.99
            report[f"batch{batch}_steps{steps}"] = row
            print(f"batch {batch} steps {steps}: {row}")
    report["ok"] = ok
    print("OK" if ok else "FAILED")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
