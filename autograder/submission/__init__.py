"""What is graded: each lab's `LabSpec`, a submitted notebook read into the cells to run, whether a graded
name is the learner's own code, and the folders of hidden tests. Plain data; runs in the grader."""
