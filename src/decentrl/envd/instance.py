"""One environment instance: a child process of the env server hosting live sessions of one environment.

`python -m decentrl.envd.instance '{"env": NAME, "args": {...}}'` loads the environment, says it is
ready (with the environment's version) and then answers one JSON request per line on stdin with one
JSON line on stdout, in order:

    {"op": "open", "session": S, "seed": N}     -> {}   (a reset)
    {"op": "step", "session": S, "action": T}   -> {"reply": [messages] | null}
    {"op": "reward", "session": S, "final_action": T | null} -> {"reward": r}
    {"op": "close", "session": S}                -> {}
    {"op": "screenshot", "session": S}           -> {"png": base64 | null}

An exception the environment raises on a request is answered as {"error": ...}: the env server
fails that episode (`error`) and keeps the instance. `InstanceBroken` (a browser that died) ends
the process (exit 3): the env server sees a crash and starts a fresh instance.
"""

from __future__ import annotations

import base64
import json
import sys

from decentrl.envs.live import EnvSession, InstanceBroken, env_version, open_session
from decentrl.envs.registry import load_environment

GONE_EXIT = 3


def answer(env, sessions: dict[str, EnvSession], request: dict) -> dict:
    op, key = request["op"], request.get("session", "")
    if op == "open":
        problem = env.problem(int(request["seed"]), "train")
        sessions[key] = open_session(env, problem)
        return {}
    session = sessions[key]
    if op == "step":
        return {"reply": session.step(str(request["action"]))}
    if op == "reward":
        return {"reward": float(session.reward(request.get("final_action")))}
    if op == "screenshot":
        shot = getattr(session, "screenshot", None)
        return {"png": base64.b64encode(shot()).decode() if shot is not None else None}
    assert op == "close", f"unknown op {op!r}"
    sessions.pop(key).close()
    return {}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    env = load_environment(spec["env"], **spec.get("args", {}))
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing an environment prints may corrupt the answers
    out.write(json.dumps({"ready": True, "version": env_version(env)}) + "\n")
    out.flush()
    sessions: dict[str, EnvSession] = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = answer(env, sessions, request)
        except InstanceBroken as exc:
            out.write(json.dumps({"error": f"instance broken: {exc}", "fatal": True}) + "\n")
            out.flush()
            return GONE_EXIT
        except Exception as exc:  # the environment's failure on this episode: reported, not fatal
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    close = getattr(env, "close", None)
    if close is not None:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
