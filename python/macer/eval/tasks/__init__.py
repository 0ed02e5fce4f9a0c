"""lmms-eval task YAMLs shipped with macer (``dailyomni``, ``avutbench``) and their functions (``mcq``)."""
