import csv,sys,collections
t=collections.defaultdict(float);n=collections.Counter()
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>14]
for r in rows[1:]:
    try: v=float(r[-1].replace(',',''))
    except: continue
    k=r[4][:70]; t[k]+=v; n[k]+=1
tot=sum(t.values())
for k,v in sorted(t.items(),key=lambda x:-x[1])[:25]: print(f"{v/1e3:10.1f}us {n[k]:6d} {v/n[k]/1e3:7.2f}us/launch {100*v/tot:5.1f}% {k}")
print("total us",tot/1e3, "launches", sum(n.values()))
