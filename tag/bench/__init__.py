"""``tag bench``: every method (baselines, searches, TAG) on the same simulator, models, clusters
and budgets; suites, the runner (resumable) and the Markdown/plot report."""

from .report import write_report
from .runner import Cell, environment, run_suite, save_results
from .suites import METHODS, SUITES, ModelCase, SuiteConfig, full_suite, quick_suite

__all__ = ["METHODS", "SUITES", "Cell", "ModelCase", "SuiteConfig", "environment", "full_suite", "quick_suite",
           "run_suite", "save_results", "write_report"]
