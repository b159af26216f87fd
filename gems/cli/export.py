"""gems-export: merge a checkpoint's stage shards into one plain state_dict for inference.

    gems-export runs/ckpt/step-00000100 model.pt
    python -c "import torch, gems.models as m; net = m.build('resnet50', num_classes=10); \\
               net.load_state_dict(torch.load('model.pt'))"
"""
from __future__ import annotations

import sys

from gems.train import checkpoint
from gems.cli import parser, run


def main(argv: list[str] | None = None) -> None:
    p = parser("gems-export", "Write a checkpoint as one plain state_dict file.")
    p.add_argument("checkpoint", help="a checkpoint directory (step-NNNNNNNN) or a --checkpoint-dir "
                                      "(its newest complete checkpoint is used)")
    p.add_argument("output", help="file to write, e.g. model.pt")
    args = p.parse_args(argv)

    def body() -> None:
        found = checkpoint.complete(args.checkpoint)
        path = found[-1] if found else args.checkpoint
        out = checkpoint.export(path, args.output)
        print(f"gems-export: wrote {out} from {path}")

    sys.exit(run("gems-export", body))


if __name__ == "__main__":
    main()
