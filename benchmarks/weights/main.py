"""`decentrl bench weights`: delta size on a real RL run, exactness, codec speed, peer fan-out.

1. **Run replay** (`--run-dir` of a finished `decentrl demo`, or a short demo run here): every
   retained manifest of the run is re-applied from the coordinator's chunk store, each version's
   reconstructed state checked against its signed hash, the last one also against the trainer's
   checkpoint cast to the inference dtype. `delta_bytes_ratio` is the median over consecutive
   versions of delta payload bytes / full snapshot bytes in the inference dtype (uncompressed).
   Every catch-up patch is applied to the version before it and to its anchor and checked too.
   Catch-up after k versions is reported three ways: the bytes of the route the planner picks for a
   worker k versions behind (patches, deltas, snapshots), the same without patches (what workers
   had before them), and a direct delta between states k versions apart (an xor delta between the
   two exact states, for reference).
2. **Codec speed** on a synthetic state of `--state-mb` (>= 500 MB of bf16) whose changed fraction
   is the run's median: MB of state per second to encode a delta and to apply it.
3. **Fan-out** (`fanout.py`): 32 workers reach a new version from the coordinator
   alone vs. with peer relay, on loopback with token-bucket-limited uploads.

Progress on stderr, one JSON object on the last line of stdout.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from decentrl.argparser import Parser
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.codec import (
    DTYPES,
    count_changed,
    decode_state,
    encode_state,
    published_state,
    state_hash,
)
from decentrl.weights.manifest import DType, Manifest, ManifestKey, check_layout
from decentrl.weights.planner import index_entry, plan

CATCH_UP = (1, 10, 100)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_manifests(run_dir: Path) -> dict[ManifestKey, Manifest]:
    paths = sorted((run_dir / "weights" / "manifests").glob("v*.json"))
    manifests = [Manifest.model_validate_json(path.read_bytes()) for path in paths]
    for manifest in manifests:
        problem = check_layout(manifest)
        if problem:
            raise SystemExit(f"decentrl: error: {manifest.version} {manifest.kind}: {problem}")
    return {m.key: m for m in manifests}


def route_shape(steps: list[tuple[int, str]]) -> str:
    """A route's kinds in order, runs collapsed: 'patch', 'snapshot+delta', 'delta+patch', ..."""
    kinds = [kind for _, kind in steps]
    return "+".join(kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind)


class CatchUp:
    """Catch-up measurements during a replay: routes with and without patches, direct deltas, and
    every patch applied (to the version before it and to its anchor while still in the history)."""

    def __init__(self, manifests: dict[ManifestKey, Manifest], store: ChunkStore, full_bytes: int):
        self.store, self.full_bytes = store, full_bytes
        index = [index_entry(m) for m in manifests.values()]
        self.indexes = {"all": index, "no_patch": [e for e in index if e.kind != "patch"]}
        self.routes = {name: {k: [] for k in CATCH_UP} for name in self.indexes}
        self.direct: dict[int, list[float]] = {k: [] for k in CATCH_UP}
        self.shapes: dict[int, Counter[str]] = {k: Counter() for k in CATCH_UP}
        self.patches = [m for m in manifests.values() if m.kind == "patch"]
        self.wrong_patches = 0

    def measure(
        self, version: int, start: int, stride: int, history: dict[int, dict[str, torch.Tensor]]
    ) -> None:
        for patch in [p for p in self.patches if p.version == version]:
            for held in {version - 1, patch.anchor} & history.keys():
                state = {name: tensor.clone() for name, tensor in history[held].items()}
                decode_state(patch.tensors, self.store.payload(patch), state)
                self.wrong_patches += state_hash(state) != patch.state_sha256
        for k in CATCH_UP:
            if version - k < start or (version - k - start) % stride:
                continue
            for name, ratios in self.routes.items():
                route = plan(version - k, version, self.indexes[name])
                ratios[k].append(route.num_bytes / self.full_bytes)
                if name == "all":
                    self.shapes[k][route_shape(route.steps)] += 1
            delta = encode_state(history[version - k], history[version])[1]
            self.direct[k].append(len(delta) / self.full_bytes)

    def report(self) -> dict:
        def medians(ratios: dict[int, list[float]]) -> dict[str, float]:
            return {str(k): statistics.median(v) for k, v in ratios.items() if v}

        sizes = [p.payload_bytes / self.full_bytes for p in self.patches]
        return {
            "catch_up_route_ratio": medians(self.routes["all"]),
            "catch_up_route_ratio_without_patches": medians(self.routes["no_patch"]),
            "catch_up_routes": {str(k): dict(counter) for k, counter in self.shapes.items() if counter},
            "catch_up_direct_ratio": medians(self.direct),
            "patches": len(self.patches),
            "patch_bytes_ratio": statistics.median(sizes) if sizes else None,
            "patches_bit_exact": self.wrong_patches == 0,
        }


def replay_run(run_dir: Path) -> dict:
    """Re-apply every retained version of a run; sizes, exactness, catch-up ratios."""
    manifests = load_manifests(run_dir)
    store = ChunkStore(run_dir / "weights" / "chunks", durable=False)
    start = min(v for v, kind, _ in manifests if kind == "snapshot")
    last = max(v for v, _, _ in manifests)
    first = manifests[(start, "snapshot", None)]
    state: dict[str, torch.Tensor] = {}
    decode_state(first.tensors, store.payload(first), state)
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    num_elements = sum(t.numel() for t in state.values())
    bit_exact = state_hash(state) == first.state_sha256
    ratios, fractions, history = [], [], {start: {k: v.clone() for k, v in state.items()}}
    catch_up = CatchUp(manifests, store, full_bytes)
    # About 60 start points; an odd stride, so they do not line up with snapshot versions.
    stride = max(1, (last - start) // 60) | 1
    for version in range(start + 1, last + 1):
        manifest = manifests[(version, "delta", None)]
        previous = history[version - 1]
        decode_state(manifest.tensors, store.payload(manifest), state)
        bit_exact &= state_hash(state) == manifest.state_sha256
        ratios.append(manifest.payload_bytes / full_bytes)
        fractions.append(count_changed(previous, state) / num_elements)
        history[version] = {k: v.clone() for k, v in state.items()}
        history.pop(version - max(CATCH_UP) - 1, None)
        catch_up.measure(version, start, stride, history)
        if version % 50 == 0:
            say(f"replay: v{version}/{last}, median delta ratio so far {statistics.median(ratios):.4f}")
    checkpoint = run_dir / "trainer" / "latest" / "model.safetensors"
    checkpoint_state = run_dir / "trainer" / "latest" / "state.json"
    matches_trainer = None
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    if checkpoint.is_file() and json.loads(checkpoint_state.read_text())["policy_version"] == last:
        from safetensors.torch import load_file

        from decentrl.model.lora import publication_layout

        trained = load_file(str(checkpoint))
        adapters = config.get("lora", {})
        if adapters.get("rank"):  # a LoRA run checkpoints peft's names: lay them out as published
            trained = publication_layout(trained, adapters["alpha"] / adapters["rank"])
        trained = published_state(trained, first.dtype)
        if trained.keys() == state.keys():
            matches_trainer = state_hash(trained) == state_hash(state)
            bit_exact &= matches_trainer
        else:
            say("the trainer checkpoint names other tensors than the published state; not compared")
    trainer = config.get("trainer", {})
    caught_up = catch_up.report()
    return {
        "delta_bytes_ratio": statistics.median(ratios),
        "delta_bytes_ratio_p90": sorted(ratios)[int(0.9 * (len(ratios) - 1))],
        "changed_fraction_median": statistics.median(fractions),
        "snapshot_zstd_ratio": first.payload_bytes / full_bytes,
        **caught_up,
        "bit_exact": bit_exact and caught_up["patches_bit_exact"],
        "final_matches_trainer_checkpoint": matches_trainer,
        "versions_replayed": last - start,
        "state_bytes": full_bytes,
        "dtype": first.dtype,
        "lr": trainer.get("lr"),
        "lora_rank": config.get("lora", {}).get("rank", 0),
        "lr_schedule": lr_schedule(trainer),
    }


def lr_schedule(trainer: dict) -> str:
    """The run's learning-rate schedule in words (a constant one has no end point)."""
    warmup = f"warmup {trainer.get('lr_warmup_steps')} + "
    if trainer.get("lr_decay") == "constant":
        return warmup + "constant"
    return warmup + f"cosine to {trainer.get('min_lr_ratio')} x lr over {trainer.get('num_steps')} steps"


def codec_speed(state_mb: float, fraction: float, dtype: DType = "bfloat16") -> dict:
    """Encode/decode throughput (MB of state per second) of one delta on a synthetic state."""
    size = DTYPES[dtype].itemsize
    rows = int(state_mb * 1e6 / size / 4096 / 16) + 1
    generator = torch.Generator().manual_seed(0)
    old, new = {}, {}
    for i in range(16):
        weight = torch.randn(rows, 4096, generator=generator) * 0.02
        moved = weight + 1e-3 * torch.randn(weight.shape, generator=generator) * (
            torch.rand(weight.shape, generator=generator) < fraction
        )
        old[f"w{i}"], new[f"w{i}"] = weight.to(DTYPES[dtype]), moved.to(DTYPES[dtype])
    total = sum(t.numel() * t.element_size() for t in new.values())
    started = time.perf_counter()
    entries, payload = encode_state(old, new)
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    decode_state(entries, payload, old)
    decode_s = time.perf_counter() - started
    started = time.perf_counter()
    exact = state_hash(old) == state_hash(new)
    hash_s = time.perf_counter() - started
    return {
        "encode_mb_s": total / 1e6 / encode_s,
        "decode_mb_s": total / 1e6 / decode_s,
        "hash_mb_s": total / 1e6 / hash_s,
        "speed_state_mb": total / 1e6,
        "speed_changed_fraction": fraction,
        "speed_delta_ratio": len(payload) / total,
        "speed_bit_exact": exact,
    }


def run_short_demo(run_dir: Path, steps: int, overrides: list[str]) -> None:
    """A demo RL run that keeps every version's manifest (what the replay needs)."""
    settings = [f"trainer.num_steps={steps}", "weights.keep_versions=100000", *overrides]
    command = [sys.executable, "-m", "decentrl", "demo", "--run-dir", str(run_dir)]
    command += [arg for setting in settings for arg in ("--set", setting)]
    say(f"running {' '.join(command[2:])}")
    subprocess.run(command, check=True, stdout=sys.stderr)


def main(argv: list[str]) -> int:
    parser = Parser(prog="decentrl bench weights", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--run-dir", help="a finished demo run (default: run a short demo first)")
    parser.add_argument("--demo-steps", type=int, default=120, help="RL steps of the short demo")
    parser.add_argument(
        "--demo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override of the short demo",
    )
    parser.add_argument("--state-mb", type=float, default=512.0, help="state size for codec speed")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--payload-mb", type=float, default=4.0, help="size of the version fanned out")
    parser.add_argument("--upload-mb-s", type=float, default=8.0, help="upload cap of coordinator and peers")
    parser.add_argument("--skip-fanout", action="store_true")
    args = parser.parse_args(argv)
    if args.run_dir:
        run_dir = Path(args.run_dir)
        if not (run_dir / "weights" / "manifests").is_dir():
            print(
                f"decentrl: error: {run_dir} has no weights/manifests; pass the run dir of a decentrl demo",
                file=sys.stderr,
            )
            return 2
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="bench-weights-"))
        run_short_demo(run_dir, args.demo_steps, args.demo_set)
    say(f"replaying {run_dir}")
    result = replay_run(run_dir)
    say(f"codec speed on {args.state_mb:.0f} MB, changed fraction {result['changed_fraction_median']:.4f}")
    result |= codec_speed(args.state_mb, result["changed_fraction_median"])
    if not args.skip_fanout:
        from benchmarks.weights.fanout import measure_fanout

        with tempfile.TemporaryDirectory(prefix="bench-fanout-") as root:
            result |= measure_fanout(Path(root), args.workers, args.payload_mb, args.upload_mb_s)
    result["run_dir"] = str(run_dir)
    print(json.dumps(result))
    return 0
