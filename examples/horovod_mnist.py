"""Horovod's classic PyTorch MNIST example, running on flodl_opt with renames only.

The diff against Horovod's ``examples/pytorch/pytorch_mnist.py``:

    -import horovod.torch as hvd
    +import flodl_opt as hvd

plus synthetic MNIST-shaped data (28x28 images, 10 classes, generated here) instead of a download,
and no Adasum (not supported). Launch it the way you launched the Horovod script::

    mpirun -np 2 python examples/horovod_mnist.py                  # Open MPI / MPICH
    torchrun --standalone --nproc-per-node 2 examples/horovod_mnist.py
    srun -n 2 python examples/horovod_mnist.py                     # Slurm
    python examples/horovod_mnist.py                               # one process

``--sync-every K`` is the one-argument switch to local SGD: ``LocalSGDOptimizer`` in place of
``DistributedOptimizer``, averaging the weights every K steps instead of the gradients every step.
The last line of every rank reports the world size and a checksum of its final parameters
(identical on every rank).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

try:
    import flodl_opt as hvd  # was: import horovod.torch as hvd
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import flodl_opt as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST-shaped example (Horovod API on flodl_opt)")
parser.add_argument("--batch-size", type=int, default=64, metavar="N")
parser.add_argument("--test-batch-size", type=int, default=256, metavar="N")
parser.add_argument("--epochs", type=int, default=2, metavar="N")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M")
parser.add_argument("--no-cuda", action="store_true", default=False)
parser.add_argument("--seed", type=int, default=42, metavar="S")
parser.add_argument("--log-interval", type=int, default=10, metavar="N")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--train-samples", type=int, default=4096)
parser.add_argument("--test-samples", type=int, default=1024)
parser.add_argument("--sync-every", type=int, default=0,
                    help="K > 0: local SGD (LocalSGDOptimizer, average weights every K steps)")


def synthetic_mnist(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """MNIST-shaped data with learnable classes: one random 28x28 template per digit, plus noise."""
    g = torch.Generator().manual_seed(1234)
    templates = torch.randn(10, 1, 28, 28, generator=g)
    g.manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = 3.0 * templates[labels] + torch.randn(n, 1, 28, 28, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def train(epoch):
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            # Horovod: use train_sampler to determine the number of examples in this worker's partition.
            print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                epoch, batch_idx * len(data), len(train_sampler),
                100. * batch_idx / len(train_loader), loss.item()), flush=True)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    for data, target in test_loader:
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        output = model(data)
        # sum up batch loss
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        # get the index of the max log-probability
        pred = output.data.max(1, keepdim=True)[1]
        test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()

    # Horovod: use test_sampler to determine the number of examples in this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print("\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n".format(
            test_loss, 100. * test_accuracy), flush=True)
    return test_loss, test_accuracy


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    kwargs = {"num_workers": 0, "pin_memory": True} if args.cuda else {}
    train_dataset = synthetic_mnist(args.train_samples, seed=1)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler, **kwargs)

    test_dataset = synthetic_mnist(args.test_samples, seed=2)
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler, **kwargs)

    model = Net()

    # By default, the learning rate scales with the number of workers.
    lr_scaler = hvd.size()

    if args.cuda:
        # Move model to GPU.
        model.cuda()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    if args.sync_every > 0:
        # flodl_opt: the one-argument switch to local SGD (weights averaged every K steps).
        optimizer = hvd.LocalSGDOptimizer(optimizer, model=model, sync_every=args.sync_every)
    else:
        # Horovod: wrap optimizer with DistributedOptimizer.
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression, op=hvd.Average,
                                             gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        if args.sync_every > 0:
            optimizer.sync()  # evaluate the consensus
        test_loss, test_accuracy = test()

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    # one write per line, so the ranks' lines do not interleave on a shared pipe
    sys.stdout.write(f"rank {hvd.rank()} of {hvd.size()} ({hvd.launch_info().launcher}): "
                     f"final test_loss={test_loss:.6f} accuracy={test_accuracy:.4f} "
                     f"param_checksum={checksum:.17g}\n")
    sys.stdout.flush()
    hvd.shutdown()
