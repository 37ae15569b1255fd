"""Learning curves of the multi-turn example against its single-turn baseline (docs/img/agent_guess_curves.png).

    make agent   # writes runs/agent-guess and runs/agent-guess-single
    .venv/bin/python benchmarks/agent_curves.py runs/agent-guess/metrics.jsonl \
        runs/agent-guess-single/metrics.jsonl docs/img/agent_guess_curves.png
"""
import json, statistics as s, sys
import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
def load(p): return [r for r in (json.loads(l) for l in open(p) if l.strip()) if 'reward_mean' in r]
if len(sys.argv) != 4:
    sys.exit("usage: agent_curves.py MULTI_METRICS.jsonl SINGLE_METRICS.jsonl OUT.png")
m, b = load(sys.argv[1]), load(sys.argv[2])
def roll(rs, k, w=10): return [r['step'] for r in rs], [s.mean(x.get(k, 0) for x in rs[max(0,i-w+1):i+1]) for i in range(len(rs))]
fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
ax[0].plot(*roll(m, 'reward_mean'), label='multi-turn (4 turns, feedback)')
ax[0].plot(*roll(b, 'reward/correct'), label='single-turn baseline')
ax[0].axhline(0.1, ls=':', c='gray', label='1/10: best any single guess can do')
ax[0].set_title('accuracy (= reward), 10-step mean'); ax[0].set_ylim(0, 1); ax[0].legend(fontsize=8)
ax[1].plot(*roll(m, 'episode/turns')); ax[1].set_title('turns per episode (multi-turn)'); ax[1].set_ylim(1, 4.1)
ax[2].plot(*roll(m, 'episode/tool_ok_rate'), label='well-formed guesses')
ax[2].plot(*roll(b, 'reward/formatted'), label='well-formed (baseline)')
ax[2].plot(*roll(m, 'episode/masked_frac'), label='masked token fraction')
ax[2].set_ylim(0, 1.02); ax[2].legend(fontsize=8); ax[2].set_title('format and loss mask')
for a in ax: a.set_xlabel('step'); a.grid(alpha=.3)
fig.tight_layout(); fig.savefig(sys.argv[3], dpi=90)
def first(rs,k,lvl,w=20):
    for i in range(w-1,len(rs)):
        if s.mean(x[k] for x in rs[i-w+1:i+1])>=lvl: return rs[i]['step'], round(rs[i]['time_s'])
for name, rs, k in (('multi', m, 'reward_mean'), ('single', b, 'reward/correct')):
    means=[s.mean(x[k] for x in rs[i:i+20]) for i in range(len(rs)-19)]
    print(name, 'first', round(rs[0][k],3), 'best20', round(max(means),3), 'last20', round(means[-1],3), 'reach.5', first(rs,k,.5), 'reach.8', first(rs,k,.8), 'run_s', round(rs[-1]['time_s']))
w=m[-20:]
print({k: round(s.mean(x[k] for x in w),3) for k in ['episode/turns','episode/tool_ok_rate','episode/masked_frac','episode/env_s','episode/tool_calls']})
w=m[:20]
print('first20', {k: round(s.mean(x[k] for x in w),3) for k in ['episode/turns','episode/tool_ok_rate','episode/masked_frac','episode/env_s']})
print('single fmt first/last20', round(s.mean(x['reward/formatted'] for x in b[:20]),3), round(s.mean(x['reward/formatted'] for x in b[-20:]),3))
