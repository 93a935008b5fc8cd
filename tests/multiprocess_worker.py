"""One process of a two-process CPU run (started by tests/sharding_checks.py).

    python -m tests.multiprocess_worker PORT PROCESS_ID WORKDIR

Joins the other process through ``jax.distributed.initialize`` on 127.0.0.1,
builds one (data=2, fsdp=2, model=1) mesh over both processes' 2 CPU devices
each, feeds only this process's half of every global batch, trains a few
steps, saves a sharded checkpoint (with the per-process data positions) and
prints one JSON line: the losses, the parameter checksum and what it saw.
"""
import json
import os
import sys

os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.pop('XLA_FLAGS', None)

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 2)

import numpy as np  # noqa: E402

from tests import sharding_checks as common  # noqa: E402
from xfmr_jax import checkpoint, sharding  # noqa: E402
from xfmr_jax import train_state, train_steps  # noqa: E402


def main(port: str, process_id: str, workdir: str):
  sharding.initialize_distributed(f'127.0.0.1:{port}', 2, int(process_id),
                                  mode='on')
  assert jax.process_count() == 2 and jax.device_count() == 4
  model, tx = common.model_and_optimizer()
  mesh = sharding.make_mesh((2, 2, 1))
  state, shardings = train_state.create_train_state(model, tx, 0, mesh)
  train_fn, _ = train_steps.jit_steps(model, tx, 0.1, mesh=mesh,
                                state_shardings=shardings)
  rows = common.BATCH // jax.process_count()
  me = jax.process_index()
  losses = []
  for batch in common.batches():
    local = {k: v[me * rows:(me + 1) * rows] for k, v in batch.items()}
    state, metrics = train_fn(state, sharding.global_batch(local, mesh))
    losses.append(float(metrics['loss']))
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                 async_save=False)
  ckpt.save(len(losses), state, checkpoint.gather_data_state({'me': me}), {})
  restored = ckpt.restore(checkpoint.abstract_like(state))
  ckpt.close()
  data_state = checkpoint.process_data_state(restored[2])
  # Parameters are sharded over both processes; a global sum reads them all.
  checksum = float(jax.jit(lambda p: sum(jax.numpy.sum(x) for x in
                                         jax.tree.leaves(p)),
                           out_shardings=sharding.replicated(mesh))(
                               state.params))
  print(json.dumps(dict(process=me, losses=losses, checksum=checksum,
                        data_state=data_state,
                        restored_step=int(restored[1].step),
                        local_devices=jax.local_device_count())))
  sys.stdout.flush()
  jax.distributed.shutdown()


if __name__ == '__main__':
  main(*sys.argv[1:])
