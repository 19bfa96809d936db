"""Train a small MLP with DDP on ferrocomm as the torch.distributed backend:

    torchrun --nproc_per_node=2 python/examples/torch_ddp.py

On GPUs each rank takes its LOCAL_RANK's GPU (FERROCOMM_TEST_SHARE_GPU=1:
all share GPU 0); without CUDA it runs on CPU tensors, on ferrocomm's host
backend.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

import ferrocomm.torch  # noqa: F401  (registers the backend "ferrocomm")


def main() -> None:
    if torch.cuda.is_available():
        shared = os.environ.get("FERROCOMM_TEST_SHARE_GPU") == "1"
        device = torch.device("cuda", 0 if shared else int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("ferrocomm")
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(1)).to(device)

    for step in range(20):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)
        loss = nn.functional.mse_loss(model(x), x @ target)
        opt.zero_grad()
        loss.backward()  # gradients averaged across ranks by ferrocomm
        opt.step()
        if step % 5 == 0 or step == 19:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
