"""A GAN: two models, two optimizers, three losses, each with its own loss scale.

`initialize` takes lists and returns lists; `num_losses=3` gives every backward its own
dynamic loss scaler, chosen with `loss_id` (an overflow in one loss does not shrink the
others' scales). The toy task: the generator learns to sample from N(mean=3, std=0.5).

    python examples/gan.py --opt-level O1 --steps 200
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce  # F.binary_cross_entropy is unsafe in half

import ampatch as amp


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    D = nn.Sequential(nn.Linear(1, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)).to(device)
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
    [G, D], [opt_g, opt_d] = amp.initialize([G, D], [opt_g, opt_d], opt_level=args.opt_level, num_losses=3)

    batch = 128
    ones, zeros = torch.ones(batch, 1, device=device), torch.zeros(batch, 1, device=device)
    for step in range(args.steps):
        real = 3 + 0.5 * torch.randn(batch, 1, device=device)
        fake = G(torch.randn(batch, 8, device=device))

        # Discriminator: real -> 1 (loss 0), fake -> 0 (loss 1); two backwards into D's grads.
        opt_d.zero_grad()
        loss_real = bce(D(real), ones)
        with amp.scale_loss(loss_real, opt_d, loss_id=0) as scaled:
            scaled.backward()
        loss_fake = bce(D(fake.detach()), zeros)
        with amp.scale_loss(loss_fake, opt_d, loss_id=1) as scaled:
            scaled.backward()
        opt_d.step()

        # Generator: make D call its samples real (loss 2).
        opt_g.zero_grad()
        loss_g = bce(D(fake), ones)
        with amp.scale_loss(loss_g, opt_g, loss_id=2) as scaled:
            scaled.backward()
        opt_g.step()

        if step % 50 == 0:
            print(f"step {step:3d}  D {loss_real.item() + loss_fake.item():.3f}  G {loss_g.item():.3f}  "
                  f"fake mean {fake.mean().item():.2f}")

    scales = ", ".join(f"{amp.loss_scale(i):g}" for i in range(3))
    print(f"final fake mean {fake.mean().item():.2f} std {fake.std().item():.2f} (target 3.00, 0.50)  "
          f"loss scales [{scales}]")
    return fake.mean().item()


if __name__ == "__main__":
    main()
