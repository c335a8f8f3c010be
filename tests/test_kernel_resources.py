"""`benchmarks/kernel_resources.py`'s dump parsing (the compile itself needs the GPU machine)."""

from benchmarks.kernel_resources import parse_dump, parse_spills


def test_ptxas_lines_give_registers_and_shared_memory():
  text = ("ptxas info    : Compiling entry function 'main_kernel' for 'sm_90a'\n"
          "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]\n"
          "ptxas info    : Used 40 registers\n")
  assert parse_dump(text) == (168, 1024)


def test_an_unrecognised_dump_gives_none():
  assert parse_dump("nothing here") == (None, None)


def test_spills_are_read_from_the_function_properties():
  text = ("ptxas info    : Function properties for main_kernel\n"
          "    0 bytes stack frame, 24 bytes spill stores, 32 bytes spill loads\n"
          "ptxas info    : Function properties for helper\n"
          "    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
  assert parse_spills(text) == (24, 32)
  assert parse_spills("ptxas info    : Used 168 registers") == (None, None)
