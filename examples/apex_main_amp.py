"""A miniature of Apex's examples/imagenet/main_amp.py: an Apex script, run unmodified on ampatch.

It imports Apex exactly as the original does and uses what Apex training scripts use:
`apex.parallel.DistributedDataParallel`, `apex.parallel.convert_syncbn_model` (`--sync_bn`),
`apex.optimizers.FusedAdam`, `apex.fp16_utils.to_python_float`, and the starting-scale
override of NVIDIA's BERT scripts, `amp._amp_state.loss_scalers[0]._loss_scale = ...`. The
data is synthetic (ten classes of 16x16 images), so it runs anywhere in seconds. With no
Apex installed, `ampatch run --apex-alias` makes those imports load ampatch:

    ampatch run --apex-alias -- python examples/apex_main_amp.py --opt-level O2 --steps 10
    ampatch run --apex-alias -- torchrun --standalone --nproc_per_node 2 examples/apex_main_amp.py --sync_bn

On CPU the processes join a gloo group, on GPUs an nccl group (one GPU per process).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from apex.parallel import DistributedDataParallel as DDP
    from apex.fp16_utils import *  # noqa: F401,F403 - as in Apex's example (to_python_float)
    from apex import amp, optimizers
    from apex.multi_tensor_apply import multi_tensor_applier  # noqa: F401 - imported, never called
except ImportError:
    raise ImportError("Please install apex from https://www.github.com/nvidia/apex to run this example "
                      "(or run it through ampatch: ampatch run --apex-alias -- python examples/apex_main_amp.py).")


def parse(argv=None):
    parser = argparse.ArgumentParser(description="Miniature Apex ImageNet training")
    parser.add_argument("--steps", default=20, type=int, help="training iterations")
    parser.add_argument("-b", "--batch-size", default=16, type=int, help="mini-batch size per process")
    parser.add_argument("--lr", default=1e-2, type=float)
    parser.add_argument("--print-freq", "-p", default=5, type=int)
    parser.add_argument("--local_rank", default=0, type=int)
    parser.add_argument("--sync_bn", action="store_true", help="enabling apex synced BN")
    parser.add_argument("--opt-level", type=str, default="O2")
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
    parser.add_argument("--init-loss-scale", type=float, default=None,
                        help="starting loss scale, set through amp._amp_state as NVIDIA's BERT scripts do")
    parser.add_argument("--dist-url", default="env://", help="rendezvous (torchrun sets env://)")
    parser.add_argument("--world-size", default=int(os.environ.get("WORLD_SIZE", 1)), type=int)
    parser.add_argument("--rank", default=int(os.environ.get("RANK", 0)), type=int)
    parser.add_argument("--out", default=None, help="directory for a rank{N}.json summary of the run")
    return parser.parse_args(argv)


def mini_resnet(num_classes=10):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


def synthetic_imagenet(n=512, num_classes=10, size=16):
    """Noisy images whose class sets their mean colour: learnable, and fixed by the seed."""
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, num_classes, (n,), generator=gen)
    colours = 2 * torch.randn(num_classes, 3, 1, 1, generator=gen)
    images = colours[targets] + torch.randn(n, 3, size, size, generator=gen)
    return images, targets


def reduce_tensor(tensor, world_size):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= world_size
    return rt


def main(argv=None):
    args = parse(argv)
    args.distributed = args.world_size > 1
    device = torch.device("cuda", args.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if args.distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    print("opt_level = {}".format(args.opt_level))

    torch.manual_seed(args.rank)  # ranks start from different weights: DDP broadcasts rank 0's
    model = mini_resnet()
    if args.sync_bn:
        import apex
        print("using apex synced BN")
        model = apex.parallel.convert_syncbn_model(model)
    model = model.to(device)

    optimizer = optimizers.FusedAdam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    # Amp accepts either values or strings for the optional override arguments.
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                      loss_scale=args.loss_scale)
    if args.init_loss_scale is not None:
        amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale
    if args.distributed:
        model = DDP(model, delay_allreduce=True)  # after amp.initialize
    criterion = nn.CrossEntropyLoss().to(device)

    images, targets = synthetic_imagenet()
    images, targets = images[args.rank::args.world_size], targets[args.rank::args.world_size]
    batches = len(images) // args.batch_size
    losses = []
    model.train()
    end = time.time()
    for i in range(args.steps):
        b = i % batches
        input = images[b * args.batch_size:(b + 1) * args.batch_size].to(device)
        target = targets[b * args.batch_size:(b + 1) * args.batch_size].to(device)
        output = model(input)
        loss = criterion(output, target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

        reduced_loss = reduce_tensor(loss.data, args.world_size) if args.distributed else loss.data
        losses.append(to_python_float(reduced_loss))  # noqa: F405 - from apex.fp16_utils
        if i % args.print_freq == 0 or i == args.steps - 1:
            print("step {}/{}  loss {:.4f}  loss scale {:g}  time {:.3f}s".format(
                i, args.steps, losses[-1], amp._amp_state.loss_scalers[0].loss_scale(), time.time() - end))
            end = time.time()

    bare = model.module if args.distributed else model
    bns = [m for m in bare.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    summary = {
        "rank": args.rank, "losses": losses, "opt_level": amp._amp_state.opt_properties.opt_level,
        "loss_scale": amp._amp_state.loss_scalers[0].loss_scale(),
        "param_sum": sum(float(p.detach().double().sum()) for p in bare.parameters()),
        "bn_running_mean": bns[0].running_mean.tolist(), "bn_type": type(bns[0]).__name__,
        "ddp_type": type(model).__name__, "optimizer_type": type(optimizer).__name__,
    }
    print("final loss {:.4f}".format(losses[-1]))
    if args.out:
        with open(os.path.join(args.out, "rank{}.json".format(args.rank)), "w") as f:
            json.dump(summary, f)
    if args.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
