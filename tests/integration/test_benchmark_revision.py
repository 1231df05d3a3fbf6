"""A module at a git revision (pagedserve/benchmarks/revision.py): read and executed from git, or a
clear error naming the revision and the file."""
import os
import shutil

import pytest

from pagedserve.benchmarks.revision import ROOT, module_at

needs_git = pytest.mark.skipif(shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
                               reason="no git checkout here")


@needs_git
def test_a_module_at_head_is_executed_from_git():
    module = module_at("HEAD", "pagedserve/kernels/block_split_cpu.py")
    assert "split_blocks" in module["SOURCE"] and module["__name__"] == "block_split_cpu.py@HEAD"


@needs_git
def test_a_revision_without_the_file_names_both():
    with pytest.raises(SystemExit, match="--baseline-rev no-such-rev: git has no pagedserve/x.py there"):
        module_at("no-such-rev", "pagedserve/x.py")
