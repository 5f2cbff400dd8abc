"""Planning: records + budget + policy -> Plan, a pure function of its inputs.

placement (the plan as data), plan_json (a saved plan read back, every field's type checked),
plan_check (a plan checked against the model it is applied to), accounting (the one definition of
bytes a token reads), density (access density and the expert axis), planner (the function), frequency
(expert-granular placement from routing statistics), tiers (the host / disk cut), reasons (the reasons
and notes the policies share).
May import: errors, formats, model.
"""
