"""The runtime every method shares and no paper owns: the method base class and its loop
(method.py), phase timing (phases.py), typed capabilities (capabilities.py: the DAF codec
plug), deadlines and their budget (deadline.py), learnt fixed costs and backward feedback,
channel statistics (stats.py, unit_stats.py), losses, option metadata (options.py), and
process tuning (doctor, gc_pauses, malloc_tuning). See README.md here."""
