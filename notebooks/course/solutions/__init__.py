"""Solutions to the notebooks' exercises: ANSWERS maps each exercise id of notebooks/course/checks.py to its answer
(a value, or a function the student was asked to write). tests/test_exercises.py checks each against its check."""

from . import nb01, nb02, nb03, nb04, nb05, nb06, nb07, nb08, nb09, nb10, study01

ANSWERS = {
    **nb01.ANSWERS,
    **nb02.ANSWERS,
    **nb03.ANSWERS,
    **nb04.ANSWERS,
    **nb05.ANSWERS,
    **nb06.ANSWERS,
    **nb07.ANSWERS,
    **nb08.ANSWERS,
    **nb09.ANSWERS,
    **nb10.ANSWERS,
    **study01.ANSWERS,
}
