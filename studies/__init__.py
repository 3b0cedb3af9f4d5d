"""Studies built on the real runner: the ablation (ablation.py) and its report (ablation_report.py).
Above the runner, below the UI.
"""
