"""`decentrl bench pipeline`: generated tokens/s of a K-stage pipeline against the whole model in
one `hf` engine, on this machine, by batch size and added round-trip time.

The pipeline is the worker's own (`rig.py`): stage 0 in the driver's `PipelineEngine`, each later
stage in a holder's `StageServer`, over loopback HTTP through a `DelayProxy` per holder that adds
`--rtts-ms` of round trip (and one more for the handshake of each new connection). The holder's
server runs as it ships (kept connections) and, in a second arm, with a new connection per step
(`rig.py:ConnectionPerStepServer`).
The whole model is an `HFEngine` on the same weights, prompts, seed and torch threads. Every
sequence decodes `--new-tokens` tokens (EOS off), so each cell times the same number of steps; the
engines compared take turns (`measure.py`). `reading` turns the grid into round trips per token.

Per boundary codec also (`codecs.py`): the bytes of a token's hidden state, by formula and on the
wire, and the log-prob gap it adds against the whole model's recomputation.

Model: the warm-started demo model (2 layers, so K = 2 only), or `--model DIR` (SmolLM2-135M:
`decentrl model import-gguf` prints its directory). Progress on stderr, one JSON object on the last
line of stdout, the tokens/s plot at `--plot`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.pipeline.codecs import codec_table
from benchmarks.pipeline.measure import Measure
from benchmarks.pipeline.plot import plot
from benchmarks.pipeline.rig import Pipeline
from benchmarks.pipeline.workload import NO_EOS, demo_prompts, load_model, published_state
from decentrl.argparser import Parser
from decentrl.config import ConfigError
from decentrl.engines.hf import HFEngine
from decentrl.engines.model_info import load_eos_token_ids
from decentrl.envs.chat import ChatFormat
from decentrl.model.boundary_codec import CODECS
from decentrl.model.special import read_pad_token_id
from decentrl.protocol import SamplingParams
from decentrl.stage_map import StageMap

WHOLE = "whole model"
SERVERS = {"as shipped": True, "connection per step": False}
"""The holders' server in each arm: keeping connections (as it ships) or not."""


def grid(args, model_dir: Path, config: Any, state, prompts: list[list[int]], pad: int) -> tuple[list, list]:
    """(the whole model's cells by batch size, the pipeline's by stages, server, RTT and batch size):
    per RTT and batch size both servers' pipelines take turns, and with no added RTT the whole
    model with them."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    servers = SERVERS if args.both_servers else {"as shipped": True}
    cells = len(args.batch_sizes) * (1 + len(args.stages) * len(servers) * len(args.rtts_ms))
    measure = Measure(args.repeats, args.min_seconds, cells)
    whole = HFEngine.from_model_dir(model_dir, device="cpu", num_threads=args.threads)
    whole.load_weights(state, 0)
    whole.eos_token_ids = NO_EOS
    whole_cells, pipeline_cells = [], []
    for num_stages in args.stages:
        stage_map = StageMap.even(config.num_hidden_layers, num_stages, config.tie_word_embeddings)
        rigs = {
            server: Pipeline(model_dir, stage_map, state, NO_EOS, pad, codec=args.codec, keep_alive=keep)
            for server, keep in servers.items()
        }
        try:
            for rtt_ms in args.rtts_ms:
                for rig in rigs.values():
                    rig.set_rtt(rtt_ms / 1000, args.jitter_ms / 1000)
                first = rtt_ms == args.rtts_ms[0]  # a warm-up per batch size here; the rigs stay warm
                for batch in args.batch_sizes:
                    engines = {
                        s: partial(r.generate, sampling=sampling, codec=args.codec) for s, r in rigs.items()
                    }
                    if first and num_stages == args.stages[0]:
                        engines[WHOLE] = partial(whole.generate, sampling=sampling)
                    for rig in rigs.values():
                        rig.traffic()
                    label = f"K={num_stages} RTT={rtt_ms:g} B={batch}"
                    measured = measure.cells(engines, prompts[:batch], label, warm_up=first)
                    if WHOLE in measured:
                        whole_cells.append({"batch": batch, **measured[WHOLE]})
                    for server, rig in rigs.items():
                        cell = measured[server]
                        hops = rig.traffic()
                        cell["connections_per_generation_per_hop"] = round(
                            sum(t.connections for t in hops) / cell["generations"] / len(hops), 2
                        )
                        pipeline_cells.append(
                            {"stages": num_stages, "server": server, "rtt_ms": rtt_ms, "batch": batch, **cell}
                        )
                    rates = ", ".join(f"{name} {cell['tokens_per_s']:.1f}" for name, cell in measured.items())
                    tqdm.write(f"{label}: tokens/s {rates}", file=sys.stderr)
        finally:
            for rig in rigs.values():
                rig.close()
    measure.bar.close()
    return whole_cells, pipeline_cells


def reading(pipeline_cells: list[dict], new_tokens: int) -> list[dict]:
    """Where the time goes, per stages, server and batch size: the time per token at the first RTT
    of the grid, and the added round trips each token costs per hop, the least-squares slope of
    time per token per hop against the RTT (2 where each step opens a connection: a handshake, then
    the request)."""
    rows = []
    for stages, server, batch in sorted({(c["stages"], c["server"], c["batch"]) for c in pipeline_cells}):
        cells = sorted(
            (c for c in pipeline_cells if (c["stages"], c["server"], c["batch"]) == (stages, server, batch)),
            key=lambda c: c["rtt_ms"],
        )
        rtts = [c["rtt_ms"] for c in cells]
        per_hop_ms = [1000 * c["seconds"] / new_tokens / (stages - 1) for c in cells]
        row = {"stages": stages, "server": server, "batch": batch}
        row["ms_per_token_at_first_rtt"] = round(1000 * cells[0]["seconds"] / new_tokens, 2)
        row["added_rtts_per_token_per_hop"] = (
            round(statistics.linear_regression(rtts, per_hop_ms).slope, 2) if len(set(rtts)) > 1 else None
        )
        rows.append(row)
    return rows


def arguments(argv: list[str]) -> tuple[Parser, Any]:
    parser = Parser(prog="decentrl bench pipeline", description=(__doc__ or "").split("\n\n")[0])
    add = parser.add_argument
    add("--model", default=None, help="a model directory (default: the demo's warm start)")
    add("--stages", type=int, nargs="+", default=[2], help="pipeline stage counts K")
    add("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    add("--rtts-ms", type=float, nargs="+", default=[0, 20, 100, 300], help="added round-trip times")
    add("--jitter-ms", type=float, default=0.0, help="± uniform jitter of each one-way trip")
    add("--new-tokens", type=int, default=16, help="tokens decoded per sequence")
    add("--repeats", type=int, default=2, help="timed generations per engine and cell, at least")
    add("--min-seconds", type=float, default=2.0, help="timed seconds per engine and cell, at least")
    add("--codec", choices=CODECS, default="bfloat16", help="the boundary codec of the grid")
    add("--shipped-only", dest="both_servers", action="store_false", help="the shipped server only")
    add("--codec-batch", type=int, default=8, help="batch size of the bytes-on-the-wire pass")
    add("--gap-rollouts", type=int, default=256, help="rollouts per codec for the gap (0: no codec table)")
    add("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    add("--plot", type=Path, default=Path("docs/img/pipeline.png"))
    return parser, parser.parse_args(argv)


def main(argv: list[str]) -> int:
    parser, args = arguments(argv)
    torch.set_num_threads(args.threads)
    try:
        model_dir, model, name = load_model(args.model)
    except ConfigError as exc:
        parser.error(str(exc))
    config: Any = model.config
    num_layers = int(config.num_hidden_layers)
    if any(not 2 <= k <= num_layers for k in args.stages):
        parser.error(
            f"--stages {args.stages}: this model has {num_layers} layers, so 2 to {num_layers} stages; "
            "pass --model DIR for more (`decentrl model import-gguf` prints SmolLM2-135M's directory)"
        )
    eos, pad = list(load_eos_token_ids(model_dir)), read_pad_token_id(model_dir)
    chat = ChatFormat.from_model_dir(model_dir, eos)
    prompts = demo_prompts(chat, max(*args.batch_sizes, args.codec_batch))
    state = published_state(model)
    tqdm.write(
        f"bench pipeline: {name}, {num_layers} x {config.hidden_size}; load {os.getloadavg()}",
        file=sys.stderr,
    )
    started = time.time()
    whole_cells, pipeline_cells = grid(args, model_dir, config, state, prompts, pad)
    wire = (prompts[: args.codec_batch], args.new_tokens)
    codecs = (
        codec_table(model_dir, model, state, chat, eos, pad, wire, args.gap_rollouts)
        if args.gap_rollouts
        else []
    )
    summary = {
        "model": name,
        "model_dir": str(model_dir),
        "num_layers": num_layers,
        "hidden_size": int(config.hidden_size),
        **{
            key: getattr(args, key)
            for key in ("new_tokens", "codec", "threads", "repeats", "min_seconds", "jitter_ms")
        },
        "full_model": whole_cells,
        "pipeline": pipeline_cells,
        "reading": reading(pipeline_cells, args.new_tokens),
        "codecs": codecs,
        "seconds": round(time.time() - started, 1),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    if args.plot:
        summary["plot"] = str(plot(summary, args.plot))
    print(json.dumps(summary))
    return 0
