import os
import threading
from datetime import datetime
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim

if os.environ.get("EXAMPLE_BACKEND") == "nbremote":  # nbremote: the imports
    from nbremote import rpc
else:
    import torch.distributed.rpc as rpc

# Suppress deprecated ProcessGroup warning
warnings.filterwarnings("ignore", message="You are using a Backend.*ProcessGroup")


batch_size = 20
image_w = 64
image_h = 64
num_classes = 30
batch_update_size = int(os.environ.get("EXAMPLE_TRAINERS", "5"))  # test: fewer trainers in CI
num_batches = 6


def small_model(num_classes):  # test: a small CNN instead of torchvision's resnet50 (too slow for CI)
    return nn.Sequential(nn.Conv2d(3, 8, 5, stride=4), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, num_classes))


def timed_log(text):
    print(f"{datetime.now().strftime('%H:%M:%S')} {text}")


class BatchUpdateParameterServer(object):

    def __init__(self, batch_update_size=batch_update_size):
        self.model = small_model(num_classes=num_classes)  # test: was torchvision.models.resnet50
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.001, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        timed_log(f"PS got {self.curr_update_size}/{batch_update_size} updates")
        for p, g in zip(self.model.parameters(), grads):
            p.grad += g
        with self.lock:
            self.curr_update_size += 1
            fut = self.future_model

            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                timed_log("PS updated model")
                self.future_model = torch.futures.Future()

        return fut


class Trainer(object):

    def __init__(self, ps_rref):
        self.ps_rref = ps_rref
        self.loss_fn = nn.MSELoss()
        self.one_hot_indices = torch.LongTensor(batch_size) \
                                    .random_(0, num_classes) \
                                    .view(batch_size, 1)

    def get_next_batch(self):
        for _ in range(num_batches):
            inputs = torch.randn(batch_size, 3, image_w, image_h)
            labels = torch.zeros(batch_size, num_classes) \
                        .scatter_(1, self.one_hot_indices, 1)
            yield inputs, labels  # test: on the CPU (was .cuda())

    def train(self):
        name = rpc.get_worker_info().name
        m = self.ps_rref.rpc_sync().get_model()  # test: on the CPU (was .cuda())
        losses = []  # test: every batch's loss, returned to the ps
        for inputs, labels in self.get_next_batch():
            timed_log(f"{name} processing one batch")
            loss = self.loss_fn(m(inputs), labels)  # test: kept (was used at once)
            losses.append(loss.item())  # test
            loss.backward()
            timed_log(f"{name} reporting grads")
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            )  # test: on the CPU (was .cuda())
            timed_log(f"{name} got updated model")
        return losses  # test


def run_trainer(ps_rref):
    trainer = Trainer(ps_rref)
    return trainer.train()  # test: the losses


def run_ps(trainers):
    timed_log("Start training")
    ps_rref = rpc.RRef(BatchUpdateParameterServer())
    futs = []
    for trainer in trainers:
        futs.append(
            rpc.rpc_async(trainer, run_trainer, args=(ps_rref,))
        )

    for trainer, losses in zip(trainers, torch.futures.wait_all(futs)):  # test: print each trainer's losses
        print(f"{trainer} " + " ".join(f"{loss!r}" for loss in losses), flush=True)
    weights = torch.cat([p.detach().flatten() for p in ps_rref.local_value().model.parameters()])  # test
    print("weights " + " ".join(f"{w!r}" for w in weights[:8].tolist()), flush=True)  # test: a few, exact
    timed_log("Finish training")


def run(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = os.environ.get("EXAMPLE_RPC_PORT", "29500")  # test: a free port the test chose
    torch.manual_seed(rank)  # test: seeded, as a reproducible run is (the original draws unseeded)
    torch.set_num_threads(1)  # test: the same thread count in both worlds
    # Initialize the process group first
    dist.init_process_group(
        backend="gloo",
        rank=rank,
        world_size=world_size
    )
    
    options=rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16,
        rpc_timeout=60
     )
    if rank != 0:
        rpc.init_rpc(
            f"trainer{rank}",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        # trainer passively waiting for ps to kick off training iterations
    else:
        rpc.init_rpc(
            "ps",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options
        )
        run_ps([f"trainer{r}" for r in range(1, world_size)])

    # block until all rpcs finish
    rpc.shutdown()
    dist.destroy_process_group()


if __name__=="__main__":
    world_size = batch_update_size + 1
    if os.environ.get("EXAMPLE_BACKEND") == "nbremote":  # nbremote: the ps starts the trainers' kernels and
        rpc.init_rpc("ps", rank=0, world_size=world_size,  # runs every rank's run(), its own here, as written
                     workers=[f"trainer{r}" for r in range(1, world_size)])
        others = [rpc.rpc_async(f"trainer{r}", run, args=(r, world_size), timeout=0) for r in range(1, world_size)]
        run(0, world_size)
        for fut in others:
            fut.wait()
        rpc.shutdown()  # nbremote: the end of the world
    else:
        mp.spawn(run, args=(world_size, ), nprocs=world_size, join=True)
