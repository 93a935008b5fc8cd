"""The README's Python examples run as written."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'


def test_readme_python_blocks_run():
  blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.S)
  assert blocks, 'README has no python examples'
  namespace = {}
  for block in blocks:  # later blocks reuse the names of earlier ones
    exec(compile(block, str(README), 'exec'), namespace)
  assert namespace['logits'].shape == (1, 4, namespace['cfg'].vocab_size)
  assert namespace['out'].shape == (2, 6, 4, 16)
