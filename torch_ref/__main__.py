"""``torchrun --nproc_per_node=R -m torch_ref SCENARIO.npz RESULT.npz`` (`torch_ref._launch`)."""

from torch_ref._launch import main

if __name__ == "__main__":
    raise SystemExit(main())
