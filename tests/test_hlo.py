"""zerolm.compile.hlo, the one reader of a compiled program: trip counts read from a loop itself (its bound and its
start, as after a peeled first iteration), instructions whose strings hold raw newlines, and the bytes census and the
FLOPs counting the same loops the same way (a causal key-block loop at its mean trip count in both)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from zerolm.compile import bytes_moved, hlo, step_time


def _scan_of_matmuls(k: int) -> str:
    def f(x, ws):
        return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]

    return jax.jit(f).lower(jnp.zeros((8, 16)), jnp.zeros((k, 16, 16))).compile().as_text()


def _without_known_trip_count(text: str) -> str:
    """The loop as the TPU compiler writes it: no trip count stated, only the condition's bound."""
    stripped = re.sub(r',?"known_trip_count":\{"n":"\d+"\}', "", text)
    assert stripped != text
    return stripped


def _starting_at(text: str, start: int) -> str:
    """The loop's counter started at `start` (as after the compiler peeled the first iterations out of it)."""
    init = re.search(r"%(copy\.\d+) = s32\[\] copy\(%(constant\.\d+)\)\n.*tuple\(%\1,", text)
    assert init is not None
    return re.sub(rf"(%{re.escape(init.group(2))} = s32\[\] constant\()0\)", rf"\g<1>{start})", text)


def test_a_loops_trip_count_is_read_from_its_bound_and_its_start_where_the_compiler_states_none():
    matmul = 2 * 8 * 16 * 16
    text = _scan_of_matmuls(5)
    assert step_time.flops(text).total == 5 * matmul  # the compiler's known_trip_count
    read = _without_known_trip_count(text)
    assert step_time.flops(read).total == 5 * matmul and step_time.flops(read).unknown_loops == 0
    peeled = _starting_at(read, 1)
    assert step_time.flops(peeled).total == 4 * matmul  # one iteration fewer in the loop, not counted twice
    body = next(callee for _, ins in hlo.program(peeled).instructions() if ins.opcode == "while"
                for how, callee in ins.called() if how == "body")
    assert hlo.program(peeled).runs[body] == 4
    # the census counts the loop's kernels by the same runs
    assert bytes_moved.census(peeled).bytes < bytes_moved.census(read).bytes == bytes_moved.census(text).bytes


def test_an_instruction_whose_string_holds_raw_newlines_is_one_instruction():
    """A kernel's backend_config with raw newlines, one of its lines ending in `{` and one starting with `}` (which
    a line-by-line reader takes for a computation's header and end), inside the loop's body: the program reads as
    before, the kernel one instruction of that body."""
    text = _scan_of_matmuls(3)
    body = next(callee for _, ins in hlo.program(text).instructions() if ins.opcode == "while"
                for how, callee in ins.called() if how == "body")
    kernel = ('  %kernel.1 = f32[8,16]{1,0} custom-call(%copy.5), custom_call_target="tpu_custom_call", '
              'backend_config={"custom_call_config":{"body":"line one {\n}\nline \\"three\\" {"}}\n')
    root = re.search(rf"(%{re.escape(body)} .*\{{\n(?:.*\n)*?)(  ROOT )", text)
    assert root is not None
    with_kernel = text[:root.start(2)] + kernel + text[root.start(2):]
    before, after = hlo.Program(text), hlo.Program(with_kernel)
    assert set(after.computations) == set(before.computations) and after.runs == before.runs
    added = [ins for ins in after.computations[body] if ins.name == "kernel.1"]
    assert len(after.computations[body]) == len(before.computations[body]) + 1 and len(added) == 1
    assert added[0].opcode == "custom-call" and 'line \\"three\\" {' in added[0].attributes
    assert step_time.flops(with_kernel).total == step_time.flops(text).total


def test_bytes_and_flops_count_the_causal_key_block_loops_alike():
    """The blockwise attention's key-block loops (query block i reads key blocks 0..i: a bound the compiler does
    not state) run N(N+1)/2 times over N query blocks, in the FLOPs and in the bytes census alike; the census counted
    them once each before."""
    from zerolm.model import attention

    B, T, H, K, block = 1, 512, 2, 32, 128
    q = jnp.ones((B, T, H, K), jnp.float32)
    grad = jax.jit(jax.grad(lambda q, k, v: attention.blockwise_attention(q, k, v, attention.NO_BIAS, block).sum(),
                            argnums=(0, 1, 2)))
    text = grad.lower(q, q, q).compile().as_text()
    program = hlo.program(text)
    n = T // block
    bodies = [callee for _, ins in program.instructions() if ins.opcode == "while" and hlo.is_triangular(ins)
              for how, callee in ins.called() if how == "body"]
    assert len(bodies) == 2 and [program.runs[b] for b in bodies] == [n * (n + 1) / 2] * 2
    census = bytes_moved.census(text)
    flops = step_time.flops(text)
    assert census.unknown_trip_counts == flops.unknown_loops == 0 and flops.triangular_loops == 2
    # every kernel of a key-block loop's body is counted by the census as often as its dots are by the FLOPs
    in_bodies = sum(round(program.runs[b]) for b in bodies for ins in program.computations[b]
                    if ins.opcode not in bytes_moved.BOOKKEEPING)
    outside = sum(round(program.runs[c] or 1) for c in program.executed - set(bodies)
                  for ins in program.computations[c] if ins.opcode not in bytes_moved.BOOKKEEPING
                  and ins.opcode != "async-start")
    assert sum(r.executions for r in census.rows) == in_bodies + outside
