"""The fault campaign's settings and its schedule: which signal, when, and which damage, drawn from
`--seed` (the campaign itself: experiments/faults/faults.py)."""

from __future__ import annotations

import pathlib
import signal
import sys
from dataclasses import dataclass

import numpy as np

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
EXIT = {"SIGKILL": -9, "SIGINT": 130, "SIGTERM": 143}
IN_PLACE = ("flip", "truncate", "delete-file", "delete-data")  # damage the campaign run's newest checkpoint
PROBE = "nosums-flip"  # delete BLAKE3SUMS and flip: applied to a copy of the run folder
DAMAGE_KINDS = (*IN_PLACE, PROBE)


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    kills: int = 50  # signals sent (SIGKILL, SIGINT or SIGTERM), at least
    corruptions: int = 14  # damaged checkpoints, at least (each kind >= 2 with the default)
    runs: int = 5  # campaign runs the signals are spread over (more are started if the counts are not reached)
    steps: int = 300
    ckpt_every: int = 10
    keep: int = 3
    model: tuple[str, ...] = ("--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--rank", "8",
                              "--seq", "32", "--batch", "4")
    signal_weights: tuple[float, float, float] = (0.5, 0.25, 0.25)  # SIGKILL, SIGINT, SIGTERM
    p_double: float = 0.35  # SIGINT/SIGTERM sent twice
    trigger_weights: tuple[float, float, float] = (0.25, 0.45, 0.30)  # time, steps, save
    max_wait_s: float = 12.0  # time trigger: uniform(0.2, max_wait_s) s after the start
    max_wait_steps: int = 40  # steps trigger: 1..max_wait_steps newly logged steps
    max_skip_saves: int = 2  # save trigger: let 0..max_skip_saves saves pass, signal during the next
    timeout_s: float = 300.0  # a process that neither stops nor finishes within this is a hang
    compare_state: bool = True  # also compare each finished run's last checkpoint (all 77 arrays) with the reference's

    def command(self, out: pathlib.Path) -> list[str]:
        return [sys.executable, "-m", "boostjax.cli", "train", "--strategy", "btp", "--mesh", "data=2,model=2",
                *self.model, "--log-every", "1", "--eval-every", "1000", "--no-progress", "--steps", str(self.steps),
                "--ckpt-every", str(self.ckpt_every), "--keep-ckpts", str(self.keep), "--out", str(out)]


QUICK = Settings(kills=2, corruptions=1, runs=1, steps=40, ckpt_every=5, trigger_weights=(0.0, 0.6, 0.4),
                 max_wait_steps=8, max_skip_saves=1, timeout_s=120.0, compare_state=False)


# -------------------------------------------------------------------------------------- plan


def draw_fault(rng: np.random.Generator, s: Settings) -> dict:
    """One signal fault: which signal(s), and when (the schedule, drawn from the seed)."""
    sig = ("SIGKILL", "SIGINT", "SIGTERM")[rng.choice(3, p=np.asarray(s.signal_weights) / sum(s.signal_weights))]
    double = sig != "SIGKILL" and bool(rng.random() < s.p_double)
    trig = ("time", "steps", "save")[rng.choice(3, p=np.asarray(s.trigger_weights) / sum(s.trigger_weights))]
    param: float | int = {"time": lambda: round(float(rng.uniform(0.2, s.max_wait_s)), 3),
                          "steps": lambda: int(rng.integers(1, s.max_wait_steps + 1)),
                          "save": lambda: int(rng.integers(0, s.max_skip_saves + 1))}[trig]()
    return {"signal": sig, "double": double, "second_after_s": round(float(rng.uniform(0.0, 0.3)), 3),
            "trigger": trig, "param": param}


def draw_damage_kinds(rng: np.random.Generator, n: int) -> list[str]:
    """n damage kinds: every kind n // 5 times when n >= 5 (the rest from the in-place kinds), shuffled."""
    per = n // len(DAMAGE_KINDS)
    kinds = [k for k in DAMAGE_KINDS for _ in range(per)]
    kinds += [IN_PLACE[i] for i in rng.integers(0, len(IN_PLACE), n - len(kinds))]
    return [kinds[i] for i in rng.permutation(len(kinds))]
