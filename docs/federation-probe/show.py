import json, sys
t0 = None
for l in open(sys.argv[1]):
    d = json.loads(l)
    t0 = t0 or d['t']
    if d['ev'] == 'round':
        print(f"{d['t']-t0:7.2f} {d['replica']}{d['rank']} r{d['r']} q{d['quorum_id']} step{d['step']} n{d['participants']} prank{d['prank']} {d['members']} heal{d['healed_from']} commit={d['commit']} theta={d['theta0']} err={d['err']} q={d['quorum_ms']} c={d['coll_ms']} sc={d['commit_ms']}")
    else:
        print(f"{d['t']-t0:7.2f} {d['replica']}{d['rank'] if d['rank']>=0 else ''} {d['ev']} {d.get('err','')}")
