"""What a hidden test may import: `testing` (the fixtures, `expect`, the markers and shared inputs; public
as `autograder.testing`) and `scheduling` (the checks the scheduler labs share). Runs in the grader."""
