"""The seeded perturbations: reproducibility per seed, shapes and dtypes kept, inputs untouched,
the measured effect of each (noise std, masked share, dropped-token rate, blur), bf16/fp16 against
torch's own casts, FGSM/PGD against a real TorchScript surrogate, and the arguments refused."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from filters import perturb
from tests.support.images import scene

FLOATS = (np.float16, np.float32, np.float64)
INTS = (np.int32, np.int64)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def picture(dtype: Any = np.float32, batch: int = 1, size: int = 64) -> NDArray[Any]:
    """The tests' scene as [N, 3, H, W] in [0, 1]."""
    one = (scene(size, 0) / 255.0).transpose(2, 0, 1)
    return np.ascontiguousarray(np.stack([one] * batch), dtype)


def token_rows(n: int, t: int, seed: int = 0, pad_id: int = 0) -> NDArray[np.int64]:
    """Rows of ids 1..999 followed by a random amount of right padding."""
    g = rng(seed)
    ids = g.integers(1, 1000, (n, t), dtype=np.int64)
    lengths = g.integers(t // 2, t + 1, n)
    ids[np.arange(t)[None, :] >= lengths[:, None]] = pad_id
    return ids


def laplacian_var(img: NDArray[Any]) -> float:
    a = img.astype(np.float64)
    lap = (a[..., 1:-1, :-2] + a[..., 1:-1, 2:] + a[..., :-2, 1:-1] + a[..., 2:, 1:-1]
           - 4 * a[..., 1:-1, 1:-1])
    return float(lap.var())


images = st.tuples(
    st.sampled_from(FLOATS),
    st.lists(st.integers(1, 3), min_size=0, max_size=2),  # leading dims: [], [C], [N, C]
    st.integers(1, 17), st.integers(1, 17), st.integers(0, 2**32 - 1),
).map(lambda t: np.random.default_rng(t[4]).random((*t[1], t[2], t[3])).astype(t[0]))


# --- rules every random perturbation keeps -------------------------------------------------------

RANDOM_IMAGE_OPS: dict[str, Callable[[NDArray[Any], np.random.Generator], NDArray[Any]]] = {
    "gaussian_noise": lambda x, g: perturb.gaussian_noise(x, 0.08, g),
    "sign_noise": lambda x, g: perturb.sign_noise(x, 0.03, g),
    "patch_mask": lambda x, g: perturb.patch_mask(x, 0.25, 4, g, fill=0.5)[0],
    "occlude": lambda x, g: perturb.occlude(x, 0.2, g, fill=0.5)[0],
}


@pytest.mark.parametrize("name", RANDOM_IMAGE_OPS)
@settings(max_examples=40, deadline=None)
@given(x=images)
def test_random_image_ops_keep_shape_dtype_bounds_and_input(name: str, x: NDArray[Any]) -> None:
    op = RANDOM_IMAGE_OPS[name]
    before = x.copy()
    x.flags.writeable = False  # like a zero-copy view of a request's bytes
    out = op(x, rng(7))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert np.array_equal(x, before)  # never in place
    assert out.min() >= 0.0 and out.max() <= 1.0
    assert op(x, rng(7)).tobytes() == out.tobytes()


@pytest.mark.parametrize("name", RANDOM_IMAGE_OPS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_random_image_ops_differ_between_seeds(name: str, dtype: Any) -> None:
    x = picture(dtype)
    op = RANDOM_IMAGE_OPS[name]
    assert op(x, rng(1)).tobytes() == op(x, rng(1)).tobytes()
    assert op(x, rng(1)).tobytes() != op(x, rng(2)).tobytes()


@pytest.mark.parametrize("dtype", FLOATS)
def test_gaussian_noise_std_is_sigma(dtype: Any) -> None:
    x = np.full((4, 3, 128, 128), 0.5, dtype)  # 6 σ from both bounds: no clamping
    out = perturb.gaussian_noise(x, 0.08, rng()).astype(np.float64)
    assert abs(out.std() - 0.08) < 0.08 * 0.02
    assert abs(out.mean() - 0.5) < 0.002


def test_gaussian_noise_clamps_to_custom_bounds() -> None:
    x = np.zeros((3, 50, 50), np.float32)
    out = perturb.gaussian_noise(x, 2.0, rng(), lo=-0.25, hi=0.25)
    assert out.min() == np.float32(-0.25) and out.max() == np.float32(0.25)
    assert perturb.gaussian_noise(x, 0.0, rng()).tobytes() == x.tobytes()
    assert perturb.gaussian_noise(x, float(np.float32(0.0)), rng()).tobytes() == x.tobytes()


def test_sign_noise_moves_every_pixel_by_eps_either_way() -> None:
    x = np.full((2, 3, 64, 64), 0.5, np.float64)
    delta = perturb.sign_noise(x, 0.03, rng()) - x
    assert np.allclose(np.abs(delta), 0.03, rtol=0, atol=1e-12)
    assert abs((delta > 0).mean() - 0.5) < 0.01


# --- masking --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("h", "w", "patch"), [(224, 224, 16), (30, 45, 8), (5, 7, 16)])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_patch_mask_fills_exactly_the_chosen_cells(h: int, w: int, patch: int,
                                                   ratio: float) -> None:
    x = rng(3).uniform(0.1, 1.0, (2, 3, h, w)).astype(np.float32)
    out, cells = perturb.patch_mask(x, ratio, patch, rng(), fill=0.0)
    gh, gw = -(-h // patch), -(-w // patch)
    assert cells.shape == (gh, gw) and cells.dtype == np.bool_
    assert cells.sum() == int(np.floor(ratio * gh * gw + 0.5))
    pixels = np.kron(cells, np.ones((patch, patch), bool))[:h, :w]
    assert np.all(out[..., pixels] == 0.0)  # every channel, every item
    assert np.array_equal(out[..., ~pixels], x[..., ~pixels])


def test_patch_mask_larger_ratio_masks_a_superset() -> None:
    x = picture()
    _, quarter = perturb.patch_mask(x, 0.25, 8, rng(5))
    _, half = perturb.patch_mask(x, 0.5, 8, rng(5))
    assert np.all(half[quarter]) and half.sum() == 2 * quarter.sum()


def test_occlude_fills_one_block_of_the_area() -> None:
    x = rng().uniform(0.1, 1.0, (1, 3, 100, 80)).astype(np.float32)
    out, (top, left, bh, bw) = perturb.occlude(x, 0.2, rng(4))
    changed = np.any(out != x, axis=(0, 1))
    assert abs(changed.mean() - 0.2) < 0.01
    assert changed[top:top + bh, left:left + bw].all() and changed.sum() == bh * bw
    assert perturb.occlude(x, 0.0, rng())[0].tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", INTS)
def test_token_dropout_keeps_order_pads_at_the_end_and_keeps_first(dtype: Any) -> None:
    ids = token_rows(200, 77).astype(dtype)
    ids[:, 0] = 49406  # a BOS
    before = ids.copy()
    ids.flags.writeable = False
    out = perturb.token_dropout(ids, 0.15, rng(), pad_id=0, keep_first=1)
    assert out.shape == ids.shape and out.dtype == ids.dtype
    assert np.array_equal(ids, before)
    assert np.all(out[:, 0] == 49406)
    for row_in, row_out in zip(ids, out, strict=True):
        kept = row_out[row_out != 0]
        assert np.all(row_out[len(kept):] == 0)  # pads only at the end
        it = iter(row_in[row_in != 0].tolist())
        assert all(tok in it for tok in kept.tolist())  # a subsequence: order kept
    real = (ids[:, 1:] != 0).sum()
    dropped = real - (out[:, 1:] != 0).sum()
    assert abs(dropped / real - 0.15) < 0.01  # ~11,000 tokens


def test_token_dropout_edges_and_seeds() -> None:
    ids = token_rows(4, 32)
    assert perturb.token_dropout(ids, 0.0, rng()).tobytes() == ids.tobytes()
    everything = perturb.token_dropout(ids, 1.0, rng(), keep_first=2)
    assert np.array_equal(everything[:, :2], ids[:, :2]) and not everything[:, 2:].any()
    one = np.array([5, 6, 7, 8, 9, 10, 11, 12], np.int64)  # [T] works too
    assert perturb.token_dropout(one, 0.5, rng(1)).shape == (8,)
    assert perturb.token_dropout(ids, 0.3, rng(1)).tobytes() == \
        perturb.token_dropout(ids, 0.3, rng(1)).tobytes()
    assert perturb.token_dropout(ids, 0.3, rng(1)).tobytes() != \
        perturb.token_dropout(ids, 0.3, rng(2)).tobytes()


def test_token_dropout_never_drops_padding_left_or_right() -> None:
    ids = np.array([[0, 0, 0, 4, 5, 6, 7, 8]], np.int64)  # left-padded
    out = perturb.token_dropout(ids, 1.0, rng())
    assert out.tolist() == [[0] * 8]
    out = perturb.token_dropout(np.array([[0, 0, 3, 4]]), 0.0, rng())
    assert out.tolist() == [[0, 0, 3, 4]]
    ids = np.array([[1, 2, 3, 9, 9, 9]], np.int64)
    assert perturb.token_dropout(ids, 1.0, rng(), pad_id=9).tolist() == [[9] * 6]


def test_token_mask_masks_the_share_of_each_rows_real_tokens() -> None:
    ids = token_rows(50, 40)
    out, mask = perturb.token_mask(ids, 0.25, rng(), mask_id=-1)
    real = (ids != 0).sum(axis=1)
    assert np.array_equal(mask.sum(axis=1), np.floor(0.25 * real + 0.5))
    assert np.all(out[mask] == -1) and np.array_equal(out[~mask], ids[~mask])
    assert not mask[ids == 0].any()


def test_shared_mask_is_one_stream_image_first_then_text() -> None:
    image, ids = picture(batch=2), token_rows(2, 77)
    img_out, ids_out = perturb.shared_mask(1234, image, ids, 0.25, 16)
    again = perturb.shared_mask(1234, image, ids, 0.25, 16)
    assert img_out.tobytes() == again[0].tobytes() and ids_out.tobytes() == again[1].tobytes()
    g = np.random.default_rng(1234)
    want_img, cells = perturb.patch_mask(image, 0.25, 16, g)
    want_ids, tokens = perturb.token_mask(ids, 0.25, g)
    assert img_out.tobytes() == want_img.tobytes() and ids_out.tobytes() == want_ids.tobytes()
    # the same share of each
    assert cells.mean() == 0.25
    assert np.allclose(tokens.sum(axis=1) / (ids != 0).sum(axis=1), 0.25, atol=0.5 / 77)
    # the image's cells come from the seed alone, not from the pixels
    other = perturb.shared_mask(1234, rng(9).random(image.shape).astype(np.float32), ids,
                                0.25, 16)[0]
    assert np.array_equal(other == 0, img_out == 0)
    # another seed masks other cells and other tokens
    img2, ids2 = perturb.shared_mask(4321, image, ids, 0.25, 16)
    assert img2.tobytes() != img_out.tobytes() and ids2.tobytes() != ids_out.tobytes()


# --- precision -----------------------------------------------------------------------------------


def test_bf16_equals_torch_for_every_kind_of_float32() -> None:
    bits = rng().integers(0, 2**32, 200_000, dtype=np.uint32)
    specials = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45,
                         1.00390625, 1.01171875], np.float32)  # the last two: ties
    x = np.concatenate([bits.view(np.float32), specials, rng(1).random(1000, np.float32)])
    ours = perturb.precision_collapse(x, "bf16")
    theirs = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    assert ours.dtype == np.float32
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))


@pytest.mark.parametrize("dtype", FLOATS)
def test_precision_collapse_keeps_dtype_and_matches_the_casts(dtype: Any) -> None:
    x = (rng().standard_normal((3, 40, 40)) * 1000).astype(dtype)
    before = x.copy()
    fp16 = perturb.precision_collapse(x, "fp16")
    assert fp16.dtype == x.dtype
    assert fp16.tobytes() == x.astype(np.float16).astype(dtype).tobytes()
    bf16 = perturb.precision_collapse(x, "bf16")
    want = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).to(torch.float32)
    assert bf16.dtype == x.dtype and np.array_equal(bf16, want.numpy().astype(dtype))
    rounded = perturb.precision_collapse(x, "round", decimals=1)
    assert rounded.dtype == x.dtype
    assert np.array_equal(rounded, np.round(x.astype(np.float64), 1).astype(dtype))
    assert np.array_equal(x, before)


def test_fp16_overflow_becomes_inf_without_a_warning() -> None:
    x = np.array([1e5, -1e6, 1.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = perturb.precision_collapse(x, "fp16")
    assert out.tolist() == [np.inf, -np.inf, 1.0]


# --- image degradation ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_blur_lowers_the_laplacian_variance(dtype: Any) -> None:
    x = picture(dtype, size=96)
    soft = perturb.blur(x, 1.0)
    softer = perturb.blur(x, 3.0)
    assert soft.dtype == x.dtype and soft.shape == x.shape
    assert laplacian_var(softer) < laplacian_var(soft) < 0.5 * laplacian_var(x)
    assert abs(float(soft.astype(np.float64).mean()) - float(x.astype(np.float64).mean())) < 2e-3
    assert perturb.blur(x, 0).tobytes() == x.tobytes()


def test_blur_keeps_a_constant_image_and_handles_tiny_ones() -> None:
    flat = np.full((3, 10, 10), 0.25, np.float32)
    assert np.allclose(perturb.blur(flat, 2.0), 0.25, atol=1e-6)
    tiny = rng().random((1, 2, 1), np.float32)  # [C, H, W] smaller than the kernel
    assert perturb.blur(tiny, 5.0).shape == tiny.shape


def test_darken_and_quantise() -> None:
    x = picture()
    dark = perturb.darken(x, 0.3)
    assert dark.dtype == x.dtype and np.allclose(dark, x * 0.3)
    assert perturb.darken(x, 5.0).max() <= 1.0
    q = perturb.quantise(x, 8)
    values = np.unique(q)
    assert q.dtype == x.dtype and len(values) <= 8
    assert np.allclose(values * 7, np.round(values * 7), atol=1e-5)  # on the 8-level grid
    assert np.abs(q - x).max() <= 0.5 / 7 + 1e-6
    q2 = perturb.quantise(x * 2 - 1, 2, lo=-1.0, hi=1.0)  # type: ignore[type-var]  # ints in, refused
    assert set(np.unique(q2).tolist()) <= {-1.0, 1.0}


# --- text ----------------------------------------------------------------------------------------

TEXT = "A small red bicycle leans against a brick wall in the late afternoon sun. " * 4


def test_mixed_scripts_swaps_the_share_of_replaceable_letters() -> None:
    out = perturb.mixed_scripts(TEXT, 0.3, rng())
    replaceable = sum(ch in perturb.HOMOGLYPHS for ch in TEXT)
    swapped = [(a, b) for a, b in zip(TEXT, out, strict=True) if a != b]
    assert len(out) == len(TEXT)
    assert len(swapped) == int(np.floor(0.3 * replaceable + 0.5))
    assert all(perturb.HOMOGLYPHS[a] == b for a, b in swapped)
    assert perturb.mixed_scripts(TEXT, 0.3, rng()) == out
    assert perturb.mixed_scripts(TEXT, 0.3, rng(1)) != out
    assert perturb.mixed_scripts(TEXT, 0.0, rng()) == TEXT
    assert not any(ch in perturb.HOMOGLYPHS for ch in perturb.mixed_scripts(TEXT, 1.0, rng()))


@pytest.mark.parametrize(("text", "keep", "want"), [
    ("the quick brown fox", 0.5, "the quick"),  # 10 chars reach into "brown": cut back
    ("the quick brown fox", 0.53, "the quick"),  # the cut falls on the space
    ("the quick brown fox", 1.0, "the quick brown fox"),
    ("the quick brown fox", 0.0, ""),
    ("supercalifragilistic", 0.5, "supercalif"),  # no boundary: cut in the word
    ("line one\nline two", 0.7, "line one"),
])
def test_cut_text(text: str, keep: float, want: str) -> None:
    assert perturb.cut_text(text, keep) == want
    assert len(perturb.cut_text(text, keep)) <= np.floor(keep * len(text) + 0.5)


def test_word_dropout() -> None:
    text = " ".join(f"w{i}" for i in range(4000))
    out = perturb.word_dropout(text, 0.15, rng())
    assert abs(1 - len(out.split()) / 4000 - 0.15) < 0.02
    kept = iter(text.split())
    assert all(w in kept for w in out.split())  # order kept
    assert perturb.word_dropout(text, 0.15, rng()) == out
    assert perturb.word_dropout(text, 0.15, rng(1)) != out
    assert perturb.word_dropout("a  b\n c", 0.0, rng()) == "a b c"
    assert perturb.word_dropout(text, 1.0, rng()) == ""


# --- FGSM / PGD against a real TorchScript surrogate ---------------------------------------------


class Similarity(torch.nn.Module):
    """A tiny 'image-text similarity': conv features, ReLU, pooled, cosine to a fixed vector."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.register_buffer("text", torch.randn(8))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        feats = torch.relu(self.conv(image)).mean(dim=(2, 3))
        return torch.nn.functional.cosine_similarity(feats, self.text[None], dim=1)  # type: ignore[index]


class PairSimilarity(torch.nn.Module):
    """The same with the text vector passed in (``fgsm``'s ``target``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        feats = torch.relu(self.conv(image)).mean(dim=(2, 3))
        return torch.nn.functional.cosine_similarity(feats, text[None], dim=1)


def save_script(module: torch.nn.Module, path: Path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is the contract
        torch.jit.script(module).save(str(path))  # type: ignore[no-untyped-call]
    return str(path)


@pytest.fixture(scope="module")
def surrogate_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    return save_script(Similarity(), tmp_path_factory.mktemp("surrogate") / "sim.pt")


def similarity(path: str, x: NDArray[Any]) -> float:
    raise_ = perturb.load_surrogate(path, mode="raise")
    with torch.no_grad():
        return float(raise_(torch.from_numpy(x.astype(np.float32))))


def test_fgsm_lowers_the_similarity_more_than_sign_noise_and_pgd_more(
        surrogate_path: str) -> None:
    x = picture(size=48)
    loss = perturb.load_surrogate(surrogate_path)  # mode "lower"
    clean = similarity(surrogate_path, x)
    noisy = similarity(surrogate_path, perturb.sign_noise(x, 0.03, rng()))
    adv = perturb.fgsm(x, 0.03, loss)
    pgd = perturb.fgsm(x, 0.03, loss, steps=5)
    assert similarity(surrogate_path, adv) < clean - 0.005
    assert clean - similarity(surrogate_path, adv) > 3 * abs(clean - noisy)
    assert similarity(surrogate_path, pgd) <= similarity(surrogate_path, adv) + 1e-6
    for out in (adv, pgd):
        assert out.dtype == x.dtype and out.shape == x.shape
        assert np.abs(out - x).max() <= 0.03 + 1e-6
        assert out.min() >= 0.0 and out.max() <= 1.0
    assert perturb.fgsm(x, 0.03, loss, steps=5).tobytes() == pgd.tobytes()  # no hidden rng


def test_fgsm_raise_mode_raises_and_dtypes_are_kept(surrogate_path: str) -> None:
    x = picture(size=48)
    up = perturb.fgsm(x, 0.03, perturb.load_surrogate(surrogate_path, mode="raise"))
    assert similarity(surrogate_path, up) > similarity(surrogate_path, x) + 0.005
    for dtype in (np.float16, np.float64):
        out = perturb.fgsm(x.astype(dtype), 0.03, perturb.load_surrogate(surrogate_path))  # type: ignore[type-var]
        assert out.dtype == dtype
        assert np.abs(out.astype(np.float64) - x.astype(dtype)).max() <= 0.03 + 1e-3


def test_fgsm_passes_the_target_to_the_surrogate(tmp_path: Path) -> None:
    torch.manual_seed(1)
    loss = perturb.load_surrogate(save_script(PairSimilarity(), tmp_path / "pair.pt"))
    x, text = picture(size=48), torch.randn(8)
    adv = perturb.fgsm(x, 0.03, loss, text, steps=3)
    with torch.no_grad():
        before = float(loss(torch.from_numpy(x), text))
        after = float(loss(torch.from_numpy(adv), text))
    assert after > before  # the loss (minus the similarity) went up


def test_fgsm_refuses_surrogates_that_give_no_usable_loss() -> None:
    x = picture(size=48)
    with pytest.raises(ValueError, match="surrogate: expected a scalar"):
        perturb.fgsm(x, 0.03, lambda t: t * 2)
    with pytest.raises(ValueError, match="surrogate: expected a loss that depends"):
        perturb.fgsm(x, 0.03, lambda t: torch.tensor(1.0))


def test_without_torch_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                 surrogate_path: str) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'mmguard\[torch\]'"):
        perturb.load_surrogate(surrogate_path)
    with pytest.raises(RuntimeError, match=r"mmguard\[torch\]"):
        perturb.fgsm(picture(size=48), 0.03, lambda t: t.sum())


# --- arguments refused ---------------------------------------------------------------------------

X = np.zeros((1, 3, 8, 8), np.float32)
IDS = np.ones((1, 8), np.int64)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: perturb.gaussian_noise(X, -0.1, rng()), r"sigma: expected .*>= 0.*got -0.1"),
    (lambda: perturb.gaussian_noise(X, float("nan"), rng()), r"sigma: expected a finite"),
    (lambda: perturb.gaussian_noise(X.astype(np.int32), 0.1, rng()),  # type: ignore[type-var]  # wrong on purpose
     r"x: expected a float16/float32/float64 numpy array, got int32"),
    (lambda: perturb.gaussian_noise(np.zeros(5, np.float32), 0.1, rng()),
     r"x: expected an image with at least 2 dimensions .*got shape \(5,\)"),
    (lambda: perturb.gaussian_noise(X, 0.1, rng(), lo=1.0, hi=0.0), r"lo, hi: .*lo=1.0, hi=0.0"),
    (lambda: perturb.sign_noise(X, -1, rng()), r"eps: expected"),
    (lambda: perturb.patch_mask(X, 1.5, 4, rng()),
     r"ratio: expected a number in \[0, 1\], got 1.5"),
    (lambda: perturb.patch_mask(X, 0.5, 0, rng()), r"patch: expected an integer >= 1, got 0"),
    (lambda: perturb.patch_mask(X, 0.5, 2.5, rng()), r"patch: expected an integer >= 1, got 2.5"),  # type: ignore[arg-type]  # wrong on purpose
    (lambda: perturb.occlude(X, -0.1, rng()), r"area: expected"),
    (lambda: perturb.token_dropout(IDS, 1.2, rng()), r"p: expected a number in \[0, 1\], got 1.2"),
    (lambda: perturb.token_dropout(IDS, 0.1, rng(), keep_first=-1), r"keep_first: expected"),
    (lambda: perturb.token_dropout(IDS.astype(np.float32), 0.1, rng()),  # type: ignore[type-var]  # wrong on purpose
     r"ids: expected an integer numpy array .*got float32"),
    (lambda: perturb.token_mask(IDS, -0.5, rng()), r"ratio: expected"),
    (lambda: perturb.shared_mask(0, X, IDS, 0.25, 0), r"patch: expected"),
    (lambda: perturb.word_dropout("a b", 2, rng()), r"p: expected"),
    (lambda: perturb.precision_collapse(X, "int8"),  # type: ignore[arg-type]  # wrong on purpose
     r"mode: expected 'round', 'fp16' or 'bf16', got 'int8'"),
    (lambda: perturb.precision_collapse(X, "round", decimals=1.5),  # type: ignore[arg-type]  # wrong on purpose
     r"decimals: expected an integer, got 1.5"),
    (lambda: perturb.blur(X, -1.0), r"radius: expected"),
    (lambda: perturb.darken(X, -0.3), r"factor: expected"),
    (lambda: perturb.quantise(X, 1), r"levels: expected an integer >= 2, got 1"),
    (lambda: perturb.mixed_scripts("abc", 1.1, rng()), r"share: expected"),
    (lambda: perturb.cut_text("abc", -0.2), r"keep: expected"),
    (lambda: perturb.fgsm(X, 0.03, lambda t: t.sum(), steps=0), r"steps: expected .*got 0"),
    (lambda: perturb.fgsm(X, 0.03, "model.pt"), r"surrogate: expected a callable, got str"),  # type: ignore[arg-type]  # wrong on purpose
    (lambda: perturb.load_surrogate("/nonexistent/sim.pt"), r"path: expected a TorchScript"),
    (lambda: perturb.load_surrogate("/nonexistent/sim.pt", mode="up"),
     r"mode: expected 'lower' or 'raise', got 'up'"),
])
def test_bad_arguments_are_refused_with_a_message(call: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
