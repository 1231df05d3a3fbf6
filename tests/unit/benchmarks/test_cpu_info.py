"""benchmarks.cpu_info reads the CPU's model name and ISA flags from a cpuinfo file."""
from benchmarks.cpu_info import cpu_info, describe


def test_model_name_and_isa_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx2 avx512f bmi2\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    info = cpu_info(str(path))
    assert info == {"model_name": "AMD EPYC 9R14", "isa": ["avx2", "avx512f"]}
    assert describe(info) == "AMD EPYC 9R14 (avx2, avx512f)"


def test_missing_file_says_unknown(tmp_path):
    info = cpu_info(str(tmp_path / "absent"))
    assert info == {"model_name": "unknown", "isa": []}
    assert "none of avx2/avx512f/amx_tile" in describe(info)
