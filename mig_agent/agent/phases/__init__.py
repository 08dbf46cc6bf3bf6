"""The phases of one pass over the node, each a module of its own that takes what it needs
(mig_agent.agent.change's Tools, Memory and Change): ``planning``, ``refusals``, ``announce``,
``drain``, ``apply`` (with ``reboot`` and ``validators``), ``advertise`` and ``finish``;
``holders`` says which pods hold which devices. mig_agent.agent.change_pass orders them; the
node guard (mig_agent.agent.guard) cordons for them and settles the node whichever way they
end."""
