"""Check a recipe's launch layout before a long run: one training step through the recipe's launch.sh, then the
mesh line it printed against the layout asked for.

  python skills/launch-multi-node/scripts/check_mesh.py --recipe RECIPE [--nproc 2] [--pp 1] [--ep 2] [--data DIR] [--out DIR]
                                                               [-- extra train.py flags]

Runs `NPROC=.. PP=.. EP=.. bash recipes/RECIPE/launch.sh --steps 1 --ckpt-every 0 --eval-every 0 ...` (so on a
node, or inside a Slurm allocation, it uses the same torchrun/srun path as the real run; NNODES, NODE_RANK,
MASTER_ADDR and MASTER_PORT pass through from the environment), reads the line
`... | mesh pp=P dp=D cp=C ep=E on DEVICE | ...` and checks P*D*C*E = NPROC * NNODES, P = PP, E = EP, and that
step 1 finished with a finite loss. Prints the mesh and PASS, or FAIL with the reason (exit status 1).
"""

import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MESH_RE = re.compile(r"mesh pp=(\d+) dp=(\d+) cp=(\d+) ep=(\d+) on (\w+)")
STEP_RE = re.compile(r"step +1/\d+ \| loss ([-0-9.naif]+)")


def parse(log: str) -> dict:
    """The mesh, torchrun's processes per node and the first loss from launch.sh's output (what was found)."""
    found = {"error_line": next((line for line in log.splitlines() if line.startswith("error:")), None)}
    if mesh := MESH_RE.search(log):
        found.update(zip(("pp", "dp", "cp", "ep"), map(int, mesh.groups()[:4])), device=mesh.group(5))
    if nproc := re.search(r"--nproc-per-node (\d+)", log):  # launch.sh's torchrun line (set -x)
        found["nproc_per_node"] = int(nproc.group(1))
    if step := STEP_RE.search(log):
        found["loss"] = float(step.group(1))
    return found


def verify(found: dict, nnodes: int, pp: int | None, ep: int | None) -> list[str]:
    """What is wrong with a run's parse() result, given the node count and the layout asked for (None: any)."""
    problems = []
    if found.get("returncode"):
        problems.append(f"launch.sh exited with {found['returncode']}"
                        + (f": {found['error_line']}" if found.get("error_line") else ""))
    if "pp" not in found:
        return problems + ["no 'mesh pp=.. dp=.. cp=.. ep=..' line in the output"]
    world = found["pp"] * found["dp"] * found["cp"] * found["ep"]
    if "nproc_per_node" in found and world != found["nproc_per_node"] * nnodes:
        problems.append(f"pp*dp*cp*ep = {world} but torchrun started {found['nproc_per_node']} x {nnodes} nodes")
    for name, asked in (("pp", pp), ("ep", ep)):
        if asked is not None and found[name] != asked:
            problems.append(f"{name}={found[name]}, asked for {asked}")
    if "loss" not in found:
        problems.append("step 1 printed no loss")
    elif not math.isfinite(found["loss"]):
        problems.append(f"step 1 loss is {found['loss']}")
    return problems


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", required=True, help="folder name under recipes/ (any recipe folder, a copy too)")
    p.add_argument("--nproc", type=int, help="processes per node (launch.sh NPROC; default: its own)")
    p.add_argument("--pp", type=int, help="pipeline ranks (launch.sh PP; default: its own)")
    p.add_argument("--ep", type=int, help="expert-parallel ranks (launch.sh EP; default: its own)")
    p.add_argument("--data", help="token shards (launch.sh DATA; default: its own, the demo data made on first use)")
    p.add_argument("--out", help="run folder for the check (launch.sh OUT; default: runs/mesh_check_RECIPE)")
    p.add_argument("--cpu", action="store_true", help="hide GPUs (CUDA_VISIBLE_DEVICES=''): the CPU/gloo path")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the check is called hung")
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # train.py flags pass through unparsed
    args = p.parse_args(argv[:len(argv) - len(extra) - bool(extra or "--" in argv)])
    args.extra = extra
    script = ROOT / "recipes" / args.recipe / "launch.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} does not exist; name a folder under recipes/ that has a launch.sh")
    env = {**os.environ, "OUT": args.out or str(ROOT / "runs" / f"mesh_check_{args.recipe}"), "MAX_RESTARTS": "0"}
    for name in ("nproc", "pp", "ep", "data"):
        if getattr(args, name) is not None:
            env[name.upper()] = str(getattr(args, name))
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = ["bash", str(script), "--steps", "1", "--ckpt-every", "0", "--eval-every", "0", *args.extra]
    shown = " ".join(f"{k}={env[k]}" for k in ("NPROC", "PP", "EP", "DATA", "OUT")
                     if k == "OUT" or getattr(args, k.lower()) is not None)
    print(f"running: {shown} bash {script.relative_to(ROOT)} {' '.join(cmd[2:])}", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"FAIL: no result after {args.timeout:.0f} s; a rank is waiting for a peer (check MASTER_ADDR/PORT, "
              "that every node started, and the firewall)")
        sys.exit(1)
    log = proc.stdout + proc.stderr
    result = {"returncode": proc.returncode, "log": log, **parse(log)}
    if "pp" in result:
        print(f"mesh: pp={result['pp']} dp={result['dp']} cp={result['cp']} ep={result['ep']} on {result['device']} "
              f"({result['pp'] * result['dp'] * result['cp'] * result['ep']} ranks)")
    if "loss" in result:
        print(f"step 1 loss {result['loss']:.4f}")
    nnodes = os.environ.get("SLURM_NNODES") if os.environ.get("SLURM_JOB_ID") else os.environ.get("NNODES")  # as launch.sh
    problems = verify(result, int(nnodes or 1), args.pp, args.ep)
    if problems:
        print(log[-3000:], file=sys.stderr)
        print("FAIL: " + "; ".join(problems))
        sys.exit(1)
    print("PASS")
    return result


if __name__ == "__main__":
    main()
