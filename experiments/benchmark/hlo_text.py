"""Reading XLA's HLO text: instructions, shapes, matrix-product FLOPs, sources.

A compiled program's ``as_text()`` lists its computations (the entry, loop
bodies and branches, each fusion's fused computation) and in each one
instruction a line: ``%name = shape opcode(%operand, ...), attributes``, the
attributes holding a fusion's ``calls=`` and the ``metadata`` that names the
JAX source (``op_name``, ``stack_frame_id``). The module's tables
``FileNames`` ... ``StackFrames`` map a stack frame to a function and line.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2,
          'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8,
          'f64': 8, 'c64': 8, 'c128': 16}
_ARRAY = re.compile(r'\b([a-z]+\d*)\[([\d,]*)\]')


@dataclasses.dataclass
class Instruction:
  """One HLO instruction: its result shape text, opcode, operand names,
  called computation (fusions), source ``op_name`` and attribute text."""
  shape: str
  opcode: str
  operands: list
  calls: str | None
  op_name: str
  attributes: str

  @property
  def stack_frame(self) -> int | None:
    m = re.search(r'stack_frame_id=(\d+)', self.attributes)
    return int(m.group(1)) if m else None


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape, a tuple's arrays summed (``f32[8,512]``: 16384)."""
  return sum(_BYTES.get(t, 0) * math.prod(int(d) for d in dims.split(',') if d)
             for t, dims in _ARRAY.findall(shape))


def _dims(shape: str) -> list:
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(',') if d] if m else []


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group that opens at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {'(': 1, '{': 1, '[': 1, ')': -1, '}': -1, ']': -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def _frames(text: str) -> dict:
  """Stack frame id -> ``function (file:line)`` of its innermost location,
  from the module's ``FileNames`` ... ``StackFrames`` tables."""
  tables, table = collections.defaultdict(dict), None
  for line in text.split('\n'):
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      table = line
    elif table and re.match(r'^\d+ ', line):
      key, value = line.split(' ', 1)
      tables[table][int(key)] = value
    elif line.strip():
      table = None
  frames = {}
  for frame, text_ in tables['StackFrames'].items():
    loc = re.search(r'file_location_id=(\d+)', text_)
    where = tables['FileLocations'].get(int(loc.group(1)), '') if loc else ''
    ids = dict(re.findall(r'(\w+)=(\d+)', where))
    name = lambda t, k: tables[t].get(int(ids.get(k, 0)), '""').strip('"')
    frames[frame] = (f"{name('FunctionNames', 'function_name_id')} "
                     f"({name('FileNames', 'file_name_id').rsplit('/', 1)[-1]}"
                     f":{ids.get('line', '?')})")
  return frames


def parse_hlo(text: str) -> tuple[dict, dict, dict]:
  """``(instructions, computations, frames)`` of an HLO module's text:
  name -> :class:`Instruction` (names are unique in a module), computation
  name -> the names of its instructions, stack frame id -> where."""
  instructions, computations, current = {}, {}, None
  for line in text.split('\n'):
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$', line)
    if header and not line.startswith(' '):
      current = computations.setdefault(header.group(1), [])
      continue
    m = re.match(r'^\s*(?:ROOT )?%?([\w.\-]+) = ', line)
    if not m or current is None:
      continue
    rest = line[m.end():]
    end = _balanced(rest, 0) if rest.startswith('(') else rest.find(' ')
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find('(')
    if paren < 0:
      continue
    opcode = rest[:paren]
    close = _balanced(rest, paren)
    operands = re.findall(r'%([\w.\-]+)', rest[paren:close])
    attributes = rest[close:]
    calls = re.search(r'calls=%?([\w.\-]+)', attributes)
    op_name = re.search(r'op_name="([^"]*)"', attributes)
    instructions[m.group(1)] = Instruction(
        shape, opcode, operands, calls.group(1) if calls else None,
        op_name.group(1) if op_name else '', attributes)
    current.append(m.group(1))
  return instructions, computations, _frames(text)


def dot_flops(ins: Instruction, instructions: dict) -> float:
  """FLOPs of a ``dot``: 2 x output elements x contracted size."""
  lhs = instructions.get(ins.operands[0]) if ins.operands else None
  contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', ins.attributes)
  if lhs is None or contracting is None:
    return 0.0
  dims = _dims(lhs.shape)
  k = math.prod(dims[int(i)] for i in contracting.group(1).split(',') if i)
  return 2.0 * math.prod(_dims(ins.shape)) * k


def flops(name: str, instructions: dict, computations: dict) -> float:
  """Matrix-product FLOPs of one instruction (of the dots a fusion calls)."""
  ins = instructions[name]
  if ins.opcode == 'dot':
    return dot_flops(ins, instructions)
  if ins.opcode == 'fusion' and ins.calls in computations:
    return sum(dot_flops(instructions[n], instructions)
               for n in computations[ins.calls]
               if instructions[n].opcode == 'dot')
  return 0.0
