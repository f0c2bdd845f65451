"""train.py --profile-steps A-B: torch.profiler over training steps A..B (skills/capture-profile/SKILL.md).

Each rank writes a Chrome/Perfetto trace, <out>/profile/rank<N>.json (CPU ops, CUDA kernels on a GPU, each step in a
`ProfilerStep#<step>` annotation); on CUDA torch.cuda.profiler.start/stop bracket the window (nsys cudaProfilerApi).
"""

from pathlib import Path

import torch


def parse_steps(spec: str, total_steps: int) -> tuple[int, int] | None:
    """'A-B' -> (A, B), 1 <= A <= B <= total_steps; '' -> None. A bad spec raises one-line ValueError."""
    if not spec:
        return None
    first, sep, last = spec.partition("-")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        raise ValueError(f"--profile-steps {spec!r} is not A-B (two step numbers, e.g. --profile-steps 5-7)")
    a, b = int(first), int(last)
    if not 1 <= a <= b <= total_steps:
        raise ValueError(f"--profile-steps {spec}: need 1 <= A <= B <= --steps ({total_steps})")
    return a, b


class StepProfiler:
    """begin(step) at the top of a training step, end(step) after its last collective; does nothing outside A..B."""

    def __init__(self, spec: str, total_steps: int, out: str, rank: int, device: torch.device):
        self.window = parse_steps(spec, total_steps)
        self.path = Path(out) / "profile" / f"rank{rank}.json"
        self.cuda = device.type == "cuda"
        self.prof = self.mark = None

    def begin(self, step: int) -> None:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        if step == self.window[0] or self.prof is None:  # (a resumed run may start inside the window)
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
        self.mark = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.mark.__enter__()

    def end(self, step: int) -> None:
        if self.mark is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.mark.__exit__(None, None, None)
        self.mark = None
        if step == self.window[1]:
            if self.cuda:
                torch.cuda.profiler.stop()
            self.prof.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.path))
            self.prof = None
            print(f"profile of steps {self.window[0]}-{self.window[1]}: {self.path}", flush=True)
