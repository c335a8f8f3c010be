"""`benchmarks/kernel_resources.py`'s dump parsing (the compile itself needs the GPU machine)."""

from benchmarks.kernel_resources import parse_dump


def test_ptxas_lines_give_registers_and_shared_memory():
  text = ("ptxas info    : Compiling entry function 'main_kernel' for 'sm_90a'\n"
          "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]\n"
          "ptxas info    : Used 40 registers\n")
  assert parse_dump(text) == (168, 1024)


def test_an_unrecognised_dump_gives_none():
  assert parse_dump("nothing here") == (None, None)
