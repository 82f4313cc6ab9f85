"""`decentrl bench engines`: what each inference engine costs a worker, on one model.

For each engine (`hf`, `vllm`, and `openai` when `--openai-url` names a running server that was
started on this bench's model directory, printed on stderr), on a Qwen2 of `--hidden-size` x
`--num-layers` with the byte-level BPE tokenizer (random weights), the warm-started demo model
(`--demo-model`) or a pretrained directory (`--pretrained DIR`), published in bf16 as a run does:

- `tokens_per_s_demo`: generated tokens per second at the demo's lease shape (8 tasks x 8 samples,
  6 new tokens, temperature 1), median of `--repeats`;
- `tokens_per_s_256`: the same for 256 sequences (32 tasks x 8 samples) of `--new-tokens` tokens;
- `delta_apply_s`: time to put one full-parameter version (every tensor changed) into the live
  engine, median of `--repeats`;
- `mismatch_kl`: the trainer's k3 estimate of KL(engine || trainer) on the 256-sequence batch, the
  trainer's log-probs computed by its own code (`algo/logprobs.py`) in fp32: the engine gap the
  trainer's per-step `mismatch_kl` starts from before any staleness.

Run it from the interpreter that holds the engines (`.venv-vllm/bin/decentrl bench engines` on
CPU). Progress on stderr, one JSON object on the last line of stdout.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from decentrl.algo.corrections import mismatch_kl
from decentrl.algo.logprobs import sequence_logprobs
from decentrl.argparser import Parser
from decentrl.config import ModelConfig
from decentrl.engines.base import EngineUnavailable, InferenceEngine
from decentrl.engines.model_info import load_eos_token_ids
from decentrl.envs import load_environment
from decentrl.envs.chat import ChatFormat
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import SamplingParams
from decentrl.trust.logprob_tolerance import calibrate

SAMPLES_PER_TASK = 8
DEMO_TASKS, DEMO_NEW_TOKENS = 8, 6
LARGE_TASKS = 32


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_engine(name: str, model_dir: Path, args) -> InferenceEngine:
    if name == "hf":
        from decentrl.engines.hf import HFEngine

        return HFEngine.from_model_dir(model_dir, device="cpu", num_threads=args.threads)
    if name == "vllm":
        # vLLM lives in its own venv on CPU: name the interpreter to run, not the worker's setting.
        if importlib.util.find_spec("vllm") is None:
            raise EngineUnavailable(
                f"bench engines: vLLM is not installed in {sys.executable}; run the vllm part with "
                "`.venv-vllm/bin/decentrl bench engines` (`make vllm-venv` builds it), or pass --engines hf"
            )
        from decentrl.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, dtype=args.dtype)
    from decentrl.engines.openai import OpenAIEngine

    return OpenAIEngine(args.openai_url, model_dir, model_dir / "served")


def prompts_for(chat: ChatFormat, num_tasks: int) -> list[list[int]]:
    env = load_environment("arithmetic", num_digits=2)
    problems = [env.problem(seed, "train") for seed in range(num_tasks)]
    ids = [chat.prompt_ids([{"role": "user", "content": p.prompt}]) for p in problems]
    return [prompt for prompt in ids for _ in range(SAMPLES_PER_TASK)]


def throughput(engine, prompts, new_tokens: int, repeats: int) -> tuple[float, list]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    rates, completions = [], []
    for repeat in range(repeats):
        started = time.perf_counter()
        completions = engine.generate(prompts, sampling, seed=repeat)
        rates.append(sum(len(c.token_ids) for c in completions) / (time.perf_counter() - started))
    return statistics.median(rates), completions


def engine_gap(model, prompts, completions) -> tuple[float, float, list[list[float]]]:
    """k3 KL between the engine's claimed log-probs and the trainer's over every sampled token, the
    largest per-token |difference|, and every rollout's per-token |differences| (what the
    verifier's tolerance must allow: `tolerance.calibrate`)."""
    rows = [prompt + c.token_ids for prompt, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    ids_bt = torch.zeros((len(rows), width), dtype=torch.long)
    behaviour_bt = torch.zeros((len(rows), width))
    mask_bt = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids_bt[row, : len(rows[row])] = torch.tensor(rows[row])
        span = slice(len(prompt), len(rows[row]))
        behaviour_bt[row, span] = torch.tensor(completion.logprobs)
        mask_bt[row, span] = True
    with torch.no_grad():
        trainer_bt, _ = sequence_logprobs(model, ids_bt, (ids_bt != -1).long(), 1.0)
    error_bt = (trainer_bt - behaviour_bt).abs()
    errors = [error_bt[row][mask_bt[row]].tolist() for row in range(len(rows))]
    return mismatch_kl(trainer_bt, behaviour_bt, mask_bt), float(error_bt[mask_bt].max()), errors


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (t.float() + 1e-3 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in state.items()
    }


def bench_engine(name: str, model, model_dir: Path, chat: ChatFormat, state: dict, args) -> dict:
    say(f"[{name}] starting")
    started = time.perf_counter()
    engine = build_engine(name, model_dir, args)
    engine.load_weights(state, 0)
    result: dict[str, object] = {"startup_s": round(time.perf_counter() - started, 2)}
    demo = prompts_for(chat, DEMO_TASKS)
    large = prompts_for(chat, LARGE_TASKS)
    throughput(engine, demo, DEMO_NEW_TOKENS, 1)  # warm-up: first-call compilation and caches
    result["tokens_per_s_demo"] = round(throughput(engine, demo, DEMO_NEW_TOKENS, args.repeats)[0], 1)
    rate, completions = throughput(engine, large, args.new_tokens, max(1, args.repeats - 1))
    result["tokens_per_s_256"] = round(rate, 1)
    result["mismatch_kl"], result["max_logprob_diff"], errors = engine_gap(model, large, completions)
    for repeat in range(1, args.calibration_batches):  # more honest rollouts for the tolerance
        more = engine.generate(
            large, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens), 100 + repeat
        )
        errors += engine_gap(model, large, more)[2]
    result["calibration"] = calibrate(errors)
    times = []
    for version in range(1, args.repeats + 1):
        delta = perturbed(state, version)
        started = time.perf_counter()
        engine.update_weights(delta, version)
        times.append(time.perf_counter() - started)
    engine.load_weights(state, 0)
    result["delta_apply_s"] = round(statistics.median(times), 4)
    say(f"[{name}] {result}")
    return result


def bench_model(args) -> tuple:
    """(model in fp32 holding bf16-exact weights, tokenizer, model directory)."""
    if args.demo_model or args.pretrained:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from decentrl.config import DEMO_CONFIG, load_config
        from decentrl.model.resolve import resolve_model_dir

        model_dir = (
            Path(args.pretrained)
            if args.pretrained
            else resolve_model_dir(load_config(DEMO_CONFIG, []), None)
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        config = ModelConfig(
            tokenizer="bpe",
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            intermediate_size=args.intermediate_size,
        )
        model, tokenizer = build_tiny(config)
        model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="decentrl-bench-engines-"))
    # exactly what its bf16 publication holds (`to` is decorated in transformers; pyright misreads it)
    model = model.to(torch.bfloat16).float().eval()  # pyright: ignore[reportArgumentType]
    if not (args.demo_model or args.pretrained):
        save_model_dir(model, tokenizer, model_dir)
    return model, tokenizer, model_dir


def main(argv: list[str]) -> int:
    parser = Parser(prog="decentrl bench engines", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm", "openai"])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="vllm engine dtype (auto, float32, bfloat16)")
    parser.add_argument("--threads", type=int, default=2, help="hf engine torch threads")
    parser.add_argument("--openai-url", default=None, help="a server started on --model-dir (openai)")
    parser.add_argument("--model-dir", default=None, help="where the bench model is written (default: temp)")
    parser.add_argument(
        "--demo-model", action="store_true", help="the warm-started demo model instead of a random Qwen2"
    )
    parser.add_argument(
        "--pretrained",
        default=None,
        metavar="DIR",
        help="a model directory instead of a random Qwen2 (e.g. `decentrl model import-gguf`'s SmolLM2)",
    )
    parser.add_argument(
        "--calibration-batches",
        type=int,
        default=1,
        help="256-sequence batches the tolerance is calibrated on",
    )
    args = parser.parse_args(argv)
    if "openai" in args.engines and not args.openai_url:
        parser.error("--engines openai needs --openai-url of a server started on --model-dir")
    model, tokenizer, model_dir = bench_model(args)
    num_parameters = sum(p.numel() for p in model.parameters())
    say(f"model: {num_parameters / 1e6:.1f} M parameters at {model_dir}")
    chat = ChatFormat.from_model_dir(model_dir, load_eos_token_ids(model_dir))
    state = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    torch.set_num_threads(args.threads)
    results: dict[str, dict] = {}
    unavailable: list[EngineUnavailable] = []
    for name in args.engines:  # an engine missing here does not cost the others their figures
        try:
            results[name] = bench_engine(name, model, model_dir, chat, state, args)
        except EngineUnavailable as exc:
            results[name] = {"unavailable": str(exc)}
            unavailable.append(exc)
    print(
        json.dumps(
            {
                "num_parameters": num_parameters,
                "model": args.pretrained
                or (
                    "the warm-started demo model"
                    if args.demo_model
                    else f"Qwen2 {args.num_layers}x{args.hidden_size}, {args.num_heads} heads, vocab {len(tokenizer)}"
                ),
                "demo_shape": f"{DEMO_TASKS * SAMPLES_PER_TASK} sequences x {DEMO_NEW_TOKENS} new tokens",
                "large_shape": f"{LARGE_TASKS * SAMPLES_PER_TASK} sequences x {args.new_tokens} new tokens",
                "engines": results,
            }
        )
    )
    if unavailable:  # the figures above are incomplete: a one-line error and a failing status
        raise unavailable[0]
    return 0
