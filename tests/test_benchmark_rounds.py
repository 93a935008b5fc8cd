"""The benchmark's timing rounds: pauses, several calls per window, foreign
CPU load and the retry of disturbed rounds, and the torch_active worker."""
import os
import subprocess
import sys
import time

import pytest

import experiments.benchmark as package
from experiments.benchmark import common, load

HAS_PROC = load.machine_busy_s() is not None
needs_proc = pytest.mark.skipif(not HAS_PROC, reason='no /proc/stat here')
# A machine without other jobs: no round is retried.
QUIET = lambda pids: (lambda: 0.0)  # noqa: E731


def test_each_timed_run_starts_after_a_pause():
  """Runners are timed from a settled machine: the previous runner's worker
  threads are given time to stop spinning before the next one starts."""
  stamps = []

  def runner(name):
    def run():
      stamps.append((name, time.perf_counter()))
    return run

  times = common.interleave({'a': runner('a'), 'b': runner('b')}, rounds=2,
                            settle_s=0.03, min_round_s=0, measure=QUIET)
  assert [n for n, _ in stamps] == ['a', 'b', 'a', 'b']
  gaps = [t1 - t0 for (_, t0), (_, t1) in zip(stamps, stamps[1:])]
  assert min(gaps) >= 0.03
  assert all(len(ts) == 2 and max(ts) < 0.03 for ts in times.values())


class _Worker:
  """Stands in for a worker process: a batch of calls in one request."""

  def __init__(self):
    self.requests = []

  def repeat(self, n):
    self.requests.append(n)
    time.sleep(0.004 * n)


def test_a_short_step_is_called_several_times_per_round():
  calls, worker = [], _Worker()
  times = common.interleave(
      {'short': lambda: (calls.append(1), time.sleep(0.005)),
       'worker': worker}, rounds=3, settle_s=0, min_round_s=0.1,
      measure=QUIET)
  n = times.calls['short']
  assert 10 <= n <= 40 and len(calls) == 3 * n   # same count every round
  assert all(0.005 <= t < 0.02 for t in times['short'])   # per call
  # Round 1 doubles its batches up to 0.1 s; later rounds ask once.
  assert worker.requests[:2] == [1, 1] and len(set(worker.requests[-2:])) == 1
  assert worker.requests[-1] == times.calls['worker'] == sum(
      worker.requests[:-2])


def _scripted(loads, log):
  """A ``measure`` whose windows report ``loads`` in turn."""
  it = iter(loads)

  def measure(pids):
    value = next(it)
    log.append(value)
    return lambda: value
  return measure


def test_a_disturbed_round_is_run_again_whole_then_kept_and_counted():
  order, log = [], []
  runners = {k: (lambda k=k: order.append(k)) for k in 'ab'}
  # Round 1: b disturbed once, then quiet. Round 2: disturbed on every one of
  # its 1 + 3 attempts; the least disturbed (0.4) is kept.
  loads = [0.0, 0.9, 0.1, 0.0,
           0.5, 0.6, 0.7, 0.8, 0.4, 0.3, 0.9, 0.9]
  times = common.interleave(runners, rounds=2, settle_s=0, min_round_s=0,
                            threshold=0.25, retries=3,
                            measure=_scripted(loads, log))
  assert order == ['a', 'b'] * 6          # whole rounds, alternation kept
  assert len(log) == len(loads)
  assert times.retried == 1 + 3 and times.disturbed_kept == 1
  assert times.load == {'a': [0.1, 0.4], 'b': [0.0, 0.3]}
  assert len(times['a']) == len(times['b']) == 2
  assert times.load_summary('a') == dict(median=0.25, max=0.4)
  info = times.rounds_info()
  assert info['measured'] and info['max_foreign_load'] == 0.4
  assert info['rounds'] == 2 and info['threshold'] == 0.25


def test_without_a_load_measurement_nothing_is_retried():
  order = []
  runners = {k: (lambda k=k: order.append(k)) for k in 'ab'}
  times = common.interleave(runners, rounds=2, settle_s=0, min_round_s=0,
                            measure=lambda pids: (lambda: None))
  assert order == ['a', 'b', 'a', 'b']
  assert times.retried == times.disturbed_kept == 0
  assert times.load_summary('a') is None
  assert not times.rounds_info()['measured']


def test_foreign_load_is_machine_busy_minus_ours(tmp_path, monkeypatch):
  stat = tmp_path / 'stat'
  stat.write_text('cpu  100 10 50 1000 20 5 5 10 0 0\ncpu0 1 2 3 4\n')
  assert load.machine_busy_s(str(stat)) == pytest.approx(180 * load.TICK_S)
  assert load.machine_busy_s(str(tmp_path / 'none')) is None
  busy, own = iter([100.0, 100.2]), iter([5.0, 5.1])
  monkeypatch.setattr(load, 'machine_busy_s', lambda: next(busy))
  monkeypatch.setattr(load, 'own_cpu_s', lambda pids: next(own))
  stop = load.window()
  time.sleep(0.2)
  assert stop() == pytest.approx(0.1 / 0.2, rel=0.25)
  monkeypatch.setattr(load, 'machine_busy_s', lambda: None)
  monkeypatch.setattr(load, 'own_cpu_s', lambda pids: 5.0)
  assert load.window()() is None
  assert load.summary([0.1, None]) is None


def _spin(seconds):
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    pass


def _cpu_s_of_each_process():
  """{pid: user + system CPU seconds of its own threads} for every process,
  from ``/proc/<pid>/stat`` (children's time left out: it would arrive all at
  once when a child is reaped)."""
  out = {}
  for name in os.listdir('/proc'):
    if not name.isdigit():
      continue
    try:
      with open(f'/proc/{name}/stat') as f:
        stat = f.read()
    except OSError:
      continue   # gone meanwhile
    rest = stat[stat.rindex(')') + 2:].split()
    out[int(name)] = (int(rest[11]) + int(rest[12])) * load.TICK_S
  return out


def _others_busy(seconds):
  """Busy cores of all other processes while we sleep ``seconds``, summed
  process by process: an independent estimate of the foreign load (the
  machine's total in ``/proc/stat`` less our own). A process started in the
  window counts whole; one that ends in it is missed."""
  before, t0 = _cpu_s_of_each_process(), time.perf_counter()
  time.sleep(seconds)
  after, wall = _cpu_s_of_each_process(), time.perf_counter() - t0
  me = os.getpid()
  return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items()
             if pid != me) / wall


@needs_proc
def test_foreign_load_counts_other_processes_not_ours():
  # Our own CPU time is ours: a spinning window's, as the process itself
  # counts it (its share of a core depends on what else runs, e.g. other
  # test processes), and the machine's busy time includes it.
  busy0, own0, t0 = load.machine_busy_s(), load.own_cpu_s(), time.time()
  cpu0 = time.process_time()
  _spin(0.4)
  wall = time.time() - t0
  spent = time.process_time() - cpu0
  own = (load.own_cpu_s() - own0) / wall
  assert spent > 0.1 and abs(own * wall - spent) < 0.05
  assert (load.machine_busy_s() - busy0) / wall > own - 0.3
  # Whatever else runs, the load agrees with the other processes' own times.
  stop = load.window()
  assert abs(_others_busy(0.5) - stop()) < 0.4
  spinner = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
  try:
    time.sleep(0.3)   # started
    stop = load.window()
    others = _others_busy(0.5)
    foreign = stop()
    assert foreign >= 0.5 and abs(others - foreign) < 0.4
    # Counted as one of ours (a worker we drive), it is not foreign: the same
    # window measured both ways differs by the spinner's share of the cores
    # (which depends on what else runs).
    alien, ours = load.window(), load.window([spinner.pid])
    spun, t0 = _cpu_s_of_each_process()[spinner.pid], time.perf_counter()
    time.sleep(0.5)
    share = ((_cpu_s_of_each_process()[spinner.pid] - spun) /
             (time.perf_counter() - t0))
    assert share > 0.1 and abs(alien() - ours() - share) < 0.1
  finally:
    spinner.kill()
    spinner.wait()
  assert load.pid_cpu_s(spinner.pid) == 0.0   # gone


def test_torch_active_worker_imports_torch_with_the_users_policy():
  pytest.importorskip('torch', reason='torch is not installed: the '
                      'torch_active row is not run')
  from experiments.benchmark.torch_worker import TorchTrainWorker
  from xfmr_jax import config as config_lib
  cfg = config_lib.ModelConfig(**common.SIZES['tiny']['model'],
                               dropout_rate=common.DROPOUT)
  worker = TorchTrainWorker(cfg, common.random_batch(cfg.vocab_size, 4, 16))
  try:
    assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE'   # here, in the parent
    assert worker.omp_wait_policy == package.USER_OMP_WAIT_POLICY
    assert worker.first_step_s > 0 and worker.threads == os.cpu_count()
    assert worker.pids == (worker._proc.pid,) and worker._proc.is_alive()
    assert worker.repeat(3) > 0
    times = common.interleave({'w': worker}, rounds=1, settle_s=0,
                              min_round_s=0.05, measure=QUIET)
    assert times.calls['w'] >= 1 and times['w'][0] > 0
  finally:
    worker.close()
  assert not worker._proc.is_alive()


def _fake_child(loads=None, fail=()):
  """A stand-in for isolated.run_child: a result per call, recorded."""
  calls_made = []
  loads = dict(loads or {})

  def run(name, size, *, calls, min_round_s, peak_n, changes):
    calls_made.append((name, calls, changes))
    if name in fail:
      raise RuntimeError(f'{name} broke')
    seconds = {'matmul': 0.01, 'main': 0.2, 'torch': 0.3}.get(name, 0.25)
    queue = loads.get(name)
    return dict(name=name, pid=len(calls_made), seconds=seconds, calls=3,
                foreign_load=queue.pop(0) if queue else 0.0,
                omp_wait_policy='PASSIVE', malloc_applied=None,
                first_step_s=seconds, compile_s=1.0, flops=2e9)
  return run, calls_made


def test_isolated_rounds_rotate_retry_alone_and_pair_ratios_by_round():
  from experiments.benchmark import isolated
  run, made = _fake_child(loads={'torch': [0.0, 0.9, 0.1]},
                          fail=('flax_wmt',))
  out = isolated.bench_train_isolated(
      'tiny', rounds=2, use_torch=True, peak_n=64, run=run,
      contenders=('main', 'flax_wmt', 'torch'),
      variants={'gqa': lambda c: dict(num_kv_heads=c.num_heads // 2)},
      timing=dict(min_round_s=0.01, retries=2))
  order = [name for name, _, _ in made]
  # Round 1: matmul, ours, the variants, the yardsticks; round 2 starts one
  # later; a disturbed window (torch's 0.9) is timed again in a fresh
  # process, alone.
  assert order == ['matmul', 'main', 'gqa', 'flax_wmt', 'torch',
                   'main', 'gqa', 'torch', 'torch', 'matmul']
  assert [c for name, c, _ in made if name == 'main'] == [None, 3]  # fixed
  heads = common.SIZES['tiny']['model']['num_heads']
  assert {name: ch for name, _, ch in made} == dict(
      matmul=None, main={}, gqa=dict(num_kv_heads=heads // 2), flax_wmt=None,
      torch=None)
  assert out['runs']['gqa']['model_changes'] == dict(num_kv_heads=heads // 2)
  assert out['load']['retried'] == 1 and out['load']['disturbed_kept'] == 0
  assert 'flax_wmt' in out['unavailable'] and 'flax_wmt' not in out['runs']
  assert set(out['runs']) == {'main', 'gqa', 'torch'}
  assert out['ratio_vs_torch']['main'] == pytest.approx(1.5)
  peak = 2e9 / 0.01
  assert out['runs']['main']['mfu'] == pytest.approx(
      out['model_flops_per_step'] / 0.2 / peak)


def test_isolated_contenders_run_alone_each_in_a_fresh_process():
  pytest.importorskip('torch', reason='torch is not installed: the torch '
                      'contenders are not run')
  from experiments.benchmark import isolated
  results = []

  def run(*args, **kwargs):
    results.append(isolated.run_child(*args, **kwargs))
    return results[-1]

  out = isolated.bench_train_isolated(
      'tiny', rounds=1, use_torch=True, peak_n=128, run=run,
      contenders=('main_trainer_malloc', 'torch_active'),
      timing=dict(min_round_s=0.05, retries=0))
  pids = [r['pid'] for r in results]
  assert len(set(pids)) == 3 and os.getpid() not in pids
  spans = sorted((r['started'], r['ended']) for r in results)
  assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one at a time
  runs = out['runs']
  # Each child got its own settings before it imported jax or torch.
  assert runs['main_trainer_malloc']['omp_wait_policy'] == 'PASSIVE'
  assert runs['torch_active']['omp_wait_policy'] == \
      package.USER_OMP_WAIT_POLICY
  assert runs['torch_active']['malloc_applied'] is None
  if sys.platform.startswith('linux') and 'GLIBC_TUNABLES' not in os.environ:
    assert runs['main_trainer_malloc']['malloc_applied'] is True
  for row in runs.values():
    assert row['step_s'] > 0 and 0 < row['mfu'] < 2
  assert runs['main_trainer_malloc']['compile_s'] > 0
  assert runs['main_trainer_malloc']['memory']['xla_step_bytes'] > 0
  assert 'compile_s' not in runs['torch_active']
  assert out['ratio_vs_torch_active']['main_trainer_malloc'] > 0
