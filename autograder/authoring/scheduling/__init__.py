"""What the hidden tests of the scheduler labs (4 and 5) share: a learner's Scheduler against nanolab's.

Workloads are lists of events, ``("add", id, prompt_len, output_len, priority, arrival_time)``,
``("step",)`` and ``("abort", id)``, played around a scheduler by ``replay_schedule`` (the notebook's
copy in the sandbox, nanolab's here): one call runs a whole workload and brings back every step's
decisions as plain data, compared event by event. A notebook's setup cell can be edited, so its
``replay_schedule`` is not trusted: after a replay the learner's Scheduler object itself is read back
through its handle and compared with nanolab's (`check_state`). In the engine, a grader-side scheduler
plays back the learner's recorded decisions (`RecordedScheduler`), so the models run here.

A settings dict (``cfg``) has ``block_size``, ``num_blocks``, ``max_num_seqs``,
``max_num_batched_tokens``, ``scheduling_policy``, ``aging_steps`` and, for Lab 5, ``chunked``
(``enable_chunked_prefill``; Lab 4's settings have no such key and its notebook no such choice).
"""
