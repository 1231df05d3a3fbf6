"""The `budget` fixture: set the gateway's grammar budget for one test (flags as fields of
pagedserve.gateway.grammar_budget.GrammarBudget), restored to the defaults after it."""
import pytest

from pagedserve.gateway import grammar_budget
from pagedserve.gateway.grammar_budget import GrammarBudget


@pytest.fixture
def budget():
    def configure(**fields):
        return grammar_budget.configure(GrammarBudget(**fields))
    yield configure
    grammar_budget.configure(GrammarBudget())
