"""Everything of the vLLM fixture that runs INSIDE the vLLM venv (torch, transformers, vllm).

1. The tiny test models. Build them with the vLLM venv's python:

    .venv-vllm/bin/python tests/support/vllm_models.py OUT_DIR

Writes ``OUT_DIR/tiny-llama`` (text-only Llama) and ``OUT_DIR/tiny-llava`` (LLaVA with a tiny
CLIP vision tower), then prints one JSON line ``{"tiny-llama": path, "tiny-llava": path,
"seconds": s}``. Offline and deterministic (fixed corpus, fixed seeds, random weights).
Driven by ``tests.support.vllm.make_tiny_models``, which caches the result keyed on this file's
content: any change here rebuilds the models.

Both models share one tokenizer: a BPE with a Metaspace pre-tokenizer trained over printable ASCII
(byte-level BPE would decode random tokens to U+FFFD) plus "\n" and "\t", vocab 512. Special tokens:
``<unk> <s> </s> <|system|> <|user|> <|assistant|> <image>``. Generated text (random weights) is
gibberish but always printable ASCII.

* tiny-llama: hidden 64, 2 layers, 2 heads (head dim 32), intermediate 128,
  max_position_embeddings 512.
* tiny-llava: the same Llama as language model; CLIP vision tower hidden 32, 2 layers, 2 heads,
  28-px images, 14-px patches -> 2x2 = 4 patch features ("default" strategy drops CLS), so every
  image costs exactly 4 ``<image>`` tokens whatever its size (the processor resizes to 28x28).
  transformers 5.19 saves the tower as ``vision_tower.*`` (CLIPVisionModel minus its
  ``vision_model`` level) while vLLM expects ``vision_tower.vision_model.*``, so those keys are
  renamed after saving (``language_model.*`` and ``multi_modal_projector.*`` load as saved).

2. ``DelayLogitsProcessor``, a vLLM logits-processor plugin that makes a stream slow on request,
   for tests of slow backends, timeouts, cancellation and a backend dying mid-stream (the tiny
   models otherwise stream 120 tokens in ~0.3 s). ``tests.support.vllm.VllmServer`` copies this
   file as ``mmguard_vllm_models.py`` into a folder on the server's ``PYTHONPATH`` and passes
   ``--logits-processors mmguard_vllm_models:DelayLogitsProcessor``. A request opts in with
   ``"vllm_xargs": {"mmguard_delay_ms": 50}``: the engine then sleeps 50 ms before every
   sampling step (prefill included) while that request is in the batch, which slows every
   request in the same batch. Logits are untouched (same text as without). A value that is not
   a number in [0, 10000] is rejected with HTTP 400 (``param`` null).
   The class is created on first attribute access (module ``__getattr__``), so building models
   does not import vllm.
"""

from __future__ import annotations

import json
import os
import string
import sys
import time
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<image>"]
IMAGE_TOKEN = "<image>"

# Content may be a string or a list of OpenAI-style parts ({"type": "text"|"image"}): vLLM
# detects that this template loops over the parts ("openai" content format) and hands images
# over as {"type": "image"} parts, for which the template emits the <image> placeholder.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_CORPUS_TEXT = (
    "the a an of to in is it that for on with as was by be this are or from at which not have "
    "has had but were can will all one two three model image text token guard proxy server "
    "request response stream chat completion prompt length limit error vision llama small tiny "
    "hello world test data value input output shape batch size number pixel patch color red "
    "green blue black white cat dog bird tree house water light dark fast slow good bad new old"
)
_CORPUS_WORDS = _CORPUS_TEXT.split()


def _corpus() -> list[str]:
    """A fixed, deterministic training corpus that covers every printable ASCII character."""
    import random

    rng = random.Random(1234)
    lines = []
    for _ in range(3000):
        words = [rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 10_000)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":", ";"]))
    printable = string.printable.strip()  # no whitespace other than ' '
    lines.append(" ".join(printable))
    lines.append(printable)
    # multi-line samples, as the chat template makes them
    joined = ["\n".join(lines[i : i + 3]) for i in range(0, 300, 3)]
    return lines + joined + ["a\tb\tc"]


def build_tokenizer(out: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    # "\n" is its own pre-token: no merge across lines, so the template's "\n" is always one
    # token and an image part adds exactly IMAGE_TOKENS tokens, whatever text precedes it.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    # "\n" and "\t" must be in the alphabet: the chat template emits "\n", and a character
    # outside the alphabet becomes <unk> (string.printable.strip() has no whitespace).
    alphabet = sorted(set(string.printable.strip()) | {"\u2581", "\n", "\t"})
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", IMAGE_TOKEN],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _llama_config(vocab_size: int, tokenizer: object) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        torch_dtype="float32",
    )


def _write_chat_template(out: Path) -> None:
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _strip_generation_config(out: Path) -> None:
    """vLLM takes default sampling params from generation_config.json; keep none there."""
    (out / "generation_config.json").unlink(missing_ok=True)


def build_llama(out: Path) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(len(tokenizer), tokenizer))  # type: ignore[arg-type]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    _write_chat_template(out)
    _strip_generation_config(out)
    return out


def build_llava(out: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)  # type: ignore[attr-defined]
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        projection_dim=32,
        num_channels=3,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_llama_config(len(tokenizer), tokenizer),  # type: ignore[arg-type]
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = LlavaForConditionalGeneration(config)
    model.save_pretrained(out, safe_serialization=True)

    # vLLM wants vision_tower.vision_model.* (see module docstring).
    weights = out / "model.safetensors"
    tensors = load_file(str(weights))
    renamed = {}
    for key, value in tensors.items():
        for prefix in ("model.vision_tower.", "vision_tower."):
            if key.startswith(prefix) and not key.startswith(prefix + "vision_model."):
                key = prefix + "vision_model." + key[len(prefix) :]
                break
        renamed[key] = value.contiguous()
    save_file(renamed, str(weights), metadata={"format": "pt"})

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 28},
        crop_size={"height": 28, "width": 28},
        do_center_crop=True,
        do_resize=True,
        do_normalize=True,
        do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out)
    _write_chat_template(out)
    _strip_generation_config(out)
    return out


# ---------------------------------------------------------------------------------------------
# The delay plugin
# ---------------------------------------------------------------------------------------------

DELAY_ARG = "mmguard_delay_ms"
MAX_DELAY_MS = 10_000.0


def _delay_ms(params: Any) -> float:
    """The request's ``vllm_xargs.mmguard_delay_ms`` (0 if absent); ValueError if invalid."""
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(DELAY_ARG)
    if value is None:
        return 0.0
    try:
        delay = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{DELAY_ARG} must be a number of milliseconds, not {value!r}") from None
    if not 0.0 <= delay <= MAX_DELAY_MS:  # also rejects NaN
        raise ValueError(f"{DELAY_ARG} must be within [0, {MAX_DELAY_MS:.0f}], not {value!r}")
    return delay


def _make_delay_processor() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

    class DelayLogitsProcessor(LogitsProcessor):  # type: ignore[misc]
        """Sleeps before each sampling step while a request with a delay is in the batch."""

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            _delay_ms(sampling_params)

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            self._delays: dict[int, float] = {}  # batch index -> ms

        def is_argmax_invariant(self) -> bool:
            return False  # argmax-invariant processors are skipped for greedy requests

        def update_state(self, batch_update: Any) -> None:
            if batch_update is None:
                return
            # order prescribed by vLLM: removed, added, moved
            for index in batch_update.removed:
                self._delays.pop(index, None)
            for index, params, _prompt, _output in batch_update.added:
                delay = _delay_ms(params)
                if delay > 0:
                    self._delays[index] = delay
                else:
                    self._delays.pop(index, None)
            for src, dst, direction in batch_update.moved:
                moved = self._delays.pop(src, None)
                other = self._delays.pop(dst, None)
                if direction == MoveDirectionality.SWAP and other is not None:
                    self._delays[src] = other
                if moved is not None:
                    self._delays[dst] = moved

        def apply(self, logits: Any) -> Any:
            if self._delays:
                time.sleep(max(self._delays.values()) / 1000.0)
            return logits

    return DelayLogitsProcessor


def __getattr__(name: str) -> Any:
    if name == "DelayLogitsProcessor":
        cls = _make_delay_processor()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    began = time.monotonic()
    root = Path(argv[1]).resolve()
    result: dict[str, object] = {
        "tiny-llama": str(build_llama(root / "tiny-llama")),
        "tiny-llava": str(build_llava(root / "tiny-llava")),
    }
    result["seconds"] = round(time.monotonic() - began, 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    # Trap: running this file puts tests/support/ first on sys.path, where
    # tests/support/triton.py shadows the real `triton` package that torch._dynamo imports
    # ("module 'triton' has no attribute 'language'"). Drop the script's folder (the driver
    # also runs python with -P, which does the same).
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _here]
    sys.exit(main(sys.argv))
