"""pagedserve.benchmarks.cpu_info reads the CPU's model name and ISA flags from a cpuinfo file."""
from pagedserve.benchmarks.cpu_info import cpu_info, describe


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


def test_last_level_cache_is_the_highest_level(tmp_path):
    from pagedserve.wire.cpu_info import last_level_cache_bytes

    for index, level, size in [("index0", 1, "48K"), ("index2", 2, "1024K"), ("index3", 3, "32768K")]:
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(f"{level}\n")
        (tmp_path / index / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(str(tmp_path)) == 32 << 20
    assert last_level_cache_bytes(str(tmp_path / "absent")) is None
