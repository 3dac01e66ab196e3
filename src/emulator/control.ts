// The control API under /_emulator/: the emulator over HTTP for other processes (chaos, the demo, a
// person); docs/emulator.md lists the routes. JSON in, JSON out.
import type { ServerResponse } from 'node:http';
import { clock, resetProcess, type Core } from './core.ts';
import { faultRule } from './faults.ts';
import { isRecord, sendRaw } from './http.ts';
import { currentIntents, currentRefund, expireIntent, settleIntent, settleRefund, type SettleStatus } from './resources.ts';
import type { Refund, RefundStatus, WebhookTarget } from './state.ts';

export async function control(core: Core, method: string, path: string, body: string, res: ServerResponse): Promise<void> {
  const { state } = core;
  const ok = (value: unknown = { ok: true }) => sendRaw(res, 200, value ?? { ok: true });
  const route = `${method} ${path}`;
  try {
    const input = body ? JSON.parse(body) : {};
    if (!isRecord(input)) throw new Error('the body must be a JSON object');
    if (route === 'GET /_emulator/ledger') {
      const entries = await state.intents();
      const current = await currentIntents(core, entries);
      return ok(entries.map((e, i) => ({ ...e, paymentIntent: current[i] })));
    }
    if (route === 'GET /_emulator/refunds') {
      const entries = await state.refunds();
      const current: Refund[] = [];
      for (const e of entries) current.push(await currentRefund(core, e));
      return ok(entries.map((e, i) => ({ ...e, refund: current[i] })));
    }
    if (route === 'GET /_emulator/requests') return ok([...core.log]);
    if (route === 'POST /_emulator/faults') return ok({ id: await state.addFault(faultRule(input)) });
    if (route === 'DELETE /_emulator/faults') return ok(await state.clearFaults());
    if (route === 'POST /_emulator/clock/advance') return ok(await state.advanceClock(nonNegative(input.ms, 'ms')));
    if (route === 'POST /_emulator/keys/prune') {
      const olderThanMs = input.olderThanMs === undefined ? 0 : nonNegative(input.olderThanMs, 'olderThanMs');
      return ok({ pruned: await state.pruneKeys(olderThanMs, await clock(core)) });
    }
    if (route === 'POST /_emulator/search') {
      if (input.frozen !== undefined && typeof input.frozen !== 'boolean') throw new Error('frozen must be true or false');
      return ok(await state.configureSearch({
        ...(input.lagMs !== undefined ? { lagMs: nonNegative(input.lagMs, 'lagMs') } : {}),
        ...(input.frozen !== undefined ? { frozenAtMs: input.frozen ? await clock(core) : null } : {}),
      }));
    }
    if (route === 'POST /_emulator/reset') {
      resetProcess(core);
      return ok(await state.reset());
    }
    if (route === 'POST /_emulator/webhooks') return ok(await state.configureWebhooks(webhookTarget(input)));
    if (route === 'POST /_emulator/rate-limit') {
      return ok(await state.configureRateLimit(requestsPerSecond(input.requestsPerSecond, 'requestsPerSecond'), requestsPerSecond(input.accountRequestsPerSecond, 'accountRequestsPerSecond')));
    }
    if (route === 'GET /_emulator/events') return ok(await state.events());
    const settle = /^POST \/_emulator\/payment_intents\/(pi_\w+)\/settle$/.exec(route);
    if (settle) return ok(await settleIntent(core, settle[1]!, input.status as SettleStatus));
    const access = /^POST \/_emulator\/accounts\/(acct_\w+)\/(revoke|restore)$/.exec(route);
    if (access) return ok(await state.revokeAccess(access[1]!, access[2] === 'revoke'));
    const expire = /^POST \/_emulator\/payment_intents\/(pi_\w+)\/expire$/.exec(route);
    if (expire) return ok(await expireIntent(core, expire[1]!));
    const settleRefundRoute = /^POST \/_emulator\/refunds\/((?:re|pyr)_\w+)\/settle$/.exec(route);
    if (settleRefundRoute) return ok(await settleRefund(core, settleRefundRoute[1]!, input.status as RefundStatus));
    return sendRaw(res, 404, { error: `no control route ${route}` });
  } catch (err) {
    return sendRaw(res, 400, { error: (err as Error).message });
  }
}

function webhookTarget(input: Record<string, unknown>): WebhookTarget | undefined {
  if (input.url === undefined) return undefined;
  if (typeof input.url !== 'string' || typeof input.secret !== 'string') throw new Error('url and secret must be strings (an empty body turns webhooks off)');
  return { url: input.url, secret: input.secret, ...(input.delayMs !== undefined ? { delayMs: nonNegative(input.delayMs, 'delayMs') } : {}) };
}

function requestsPerSecond(v: unknown, name: string): number | null {
  if (v === undefined || v === null) return null;
  if (typeof v !== 'number' || !Number.isFinite(v) || v <= 0) throw new Error(`${name} must be a number > 0, or null (no limit)`);
  return v;
}

function nonNegative(v: unknown, name: string): number {
  if (typeof v !== 'number' || !Number.isFinite(v) || v < 0) throw new Error(`${name} must be a number ≥ 0`);
  return v;
}
