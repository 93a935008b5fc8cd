"""Import a Hugging Face Marian (opus-mt) model into a workdir.

    python -m experiments.import_marian --hf_dir=opus-mt-en-de --workdir=OUT

``--hf_dir`` is a downloaded model directory (``config.json``,
``model.safetensors`` or ``pytorch_model.bin``, ``source.spm``,
``target.spm``, ``vocab.json``). ``OUT`` becomes a workdir like a trained
one: ``python -m experiments.translate --workdir=OUT`` translates with it
(beam search under Hugging Face's scoring rules), and ``python -m
experiments.train_wmt --config=experiments/configs/finetune.py
--config.init_from=OUT ...`` fine-tunes it. No network and no torch are
needed (except to read a ``pytorch_model.bin``).
"""
from __future__ import annotations

from absl import flags

from experiments import entry
from experiments.configs import finetune

_HF_DIR = flags.DEFINE_string('hf_dir', None, 'Hugging Face Marian model '
                              'directory.', required=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Workdir to create.',
                               required=True)


def main(argv):
  if len(argv) > 1:
    entry.fail(f'unexpected arguments: {argv[1:]}')
  entry.quiet_libraries()
  from xfmr_jax import marian, model as model_lib
  fields, params, tokenizer, generation = marian.read_hf_dir(_HF_DIR.value)
  config = finetune.for_imported(fields, tokenizer.vocab_size, generation)
  marian.write_workdir(_WORKDIR.value, config, params, tokenizer)
  print(f'imported {model_lib.param_count(params) / 1e6:.1f}M parameters '
        f'(d_model {fields["d_model"]}, {fields["num_encoder_layers"]}+'
        f'{fields["num_decoder_layers"]} layers, vocab {tokenizer.vocab_size}) '
        f'into {_WORKDIR.value}')


if __name__ == '__main__':
  entry.run(main)
