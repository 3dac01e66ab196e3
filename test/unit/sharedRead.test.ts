// The console's overview figures and charts read a day (hours) of the fleet's work: one read is shared
// by every view of a replica for a while (src/console/queries.ts sharedFor), so a page left to reload, or
// many operators at once, cost the database one read per window.
import { describe, expect, it } from 'vitest';
import { sharedFor } from '../../src/console/queries.ts';

describe('a read shared by the console’s views', () => {
  it('is read once per window, again after it, and not kept when it failed', async () => {
    const reads: number[] = [];
    let fail = false;
    const read = sharedFor(10_000, async (now) => {
      reads.push(now.getTime());
      if (fail) throw new Error('the database is restarting');
      return reads.length;
    });
    const at = (ms: number) => new Date(1_000_000 + ms);
    expect(await Promise.all([read(at(0)), read(at(1)), read(at(9_999))])).toEqual([1, 1, 1]);
    expect(await read(at(10_001))).toBe(2);
    fail = true;
    await expect(read(at(20_002))).rejects.toThrow('restarting');
    fail = false;
    expect(await read(at(20_003))).toBe(4);
    expect(reads).toEqual([0, 10_001, 20_002, 20_003].map((ms) => at(ms).getTime()));
  });
});
