"""A node that runs the project's own code with its learner's contributions tampered with: the hostile member
of ``bench/attacks.py``. Everything else (membership, elections, merges when it is elected) is honest.

    python bench/hostile_node.py ATTACK [ddiloco node flags...]

ATTACK: ``flip`` (the negated outer gradient, at honest size), ``flip-x2.5`` (2.5x that: under the default
``clip_factor`` 3), ``inflate`` (negated, claiming 4x its tokens a step: the ``work_factor`` bound, 16x the
weight), ``random`` (a random direction at 3x honest size).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

ATTACKS = {  # (scale of the outer gradient, tokens multiplier, random direction)
    "flip": (-1.0, 1, False),
    "flip-x2.5": (-2.5, 1, False),
    "inflate": (-1.0, 4, False),
    "random": (3.0, 1, True),
}


def tamper(attack: str) -> None:
    from node.swarm.contributions import Contributions
    from protocol.codecs import decode_tensors, encode_tensors

    scale, inflate, rand = ATTACKS[attack]
    honest_post = Contributions.post_contribution

    def post_contribution(self, header, enc):
        delta = decode_tensors(enc)
        out = {}
        for k, d in delta.items():
            if rand:
                r = torch.randn_like(d)
                d = r * (torch.linalg.vector_norm(d) / torch.linalg.vector_norm(r).clamp_min(1e-30))
            out[k] = d * scale
        honest_post(
            self,
            replace(header, c_tokens=header.c_tokens * inflate),
            encode_tensors(out, header.codec, header.block),
        )

    Contributions.post_contribution = post_contribution


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ATTACKS:
        print(f"usage: hostile_node.py {{{'|'.join(ATTACKS)}}} [node flags...]", file=sys.stderr)
        return 2
    tamper(sys.argv[1])
    from node.cli.main import main as ddiloco

    return ddiloco(["node", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
