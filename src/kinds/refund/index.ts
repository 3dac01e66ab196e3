// The refund: money back from a succeeded charge (policy idempotent-key). Its request and input
// (request.ts), its calls (calls.ts), and how a Refund matches and settles it (evidence.ts), registered as
// any kind is.
import type { Kind } from '../../types/kind.ts';
import type { PaymentGateway } from '../../stripe/gateway.ts';
import { refundCalls } from './calls.ts';
import { REFUND, refundEvidence } from './evidence.ts';

export function refundKind(gateway: PaymentGateway): Kind {
  return { kind: REFUND, policy: 'idempotent-key', calls: refundCalls(gateway), evidence: refundEvidence(gateway) };
}
